"""A reducer's capabilities: facts of its class, never assigned on an instance.

:data:`CAPABILITIES` names them; each is a ``bool`` class attribute of
:class:`~sparsync.reducers.base.Reducer` (defaults there), checked at registration
(:func:`~sparsync.reducers.base.check_capabilities`). Most are plain ``bool`` s. A capability that a
constructor option decides (``conserving`` of gTop-k with ``residuals="global"``, micro's
``value_dtype_conserving`` with ``values="allreduce"``) is declared in the class body as an
:class:`OptionFact`: the class still reads as a ``bool`` (the default instance's fact), and an
instance reads the class's rule applied to the options it was built with. Nothing probes for a
capability (``getattr`` with a default, ``hasattr``): every reducer has every one.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["CAPABILITIES", "OptionFact", "wire_conserves"]

#: the declared capabilities of a reducer class: each a ``bool`` class attribute (defaults on ``Reducer``)
CAPABILITIES = ("has_memory", "accepts_fold", "indexed_output", "sparse_input", "checks_input", "conserving",
                "supports_value_dtype", "value_dtype_conserving", "reuse_buffers", "staged")


def wire_conserves(r) -> bool:
    """``conserving``'s part that ``value_dtype`` decides: False only when the instance sends half-precision
    values and its class sums them outside any residual (``value_dtype_conserving`` False)."""
    return r.wire_dtype is None or r.value_dtype_conserving


class OptionFact:
    """A capability that a constructor option decides, declared in the class body::

        conserving = OptionFact(False, lambda r: r.residuals == "global")

    On the class (``GTopkReducer.conserving``): ``default``, the fact of an instance built with the
    default options (what the registry checks and what a caller holding only the class reads). On
    an instance: ``rule(instance)``, the rule on the options the instance stored at construction,
    evaluated at each read (a few attribute reads). Assigning it on an instance raises
    ``AttributeError``: the fact is the class's.
    """

    def __init__(self, default: bool, rule: Callable[[object], bool]):
        if not isinstance(default, bool):
            raise TypeError(f"OptionFact default must be a bool, got {default!r}")
        self.default, self.rule, self.name = default, rule, "capability"

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, cls=None) -> bool:
        return self.default if obj is None else bool(self.rule(obj))

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is a fact of the class (an OptionFact whose "
                             "rule reads the instance's options); it cannot be assigned on an instance")
