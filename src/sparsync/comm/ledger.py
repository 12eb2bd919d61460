"""The cost ledger of a :class:`~sparsync.comm.Comm`: what one rank's calls sent and received.

:class:`PhaseCost` counts messages, bytes and sequential rounds in the alpha-beta model
``x*alpha + y*beta`` (``x`` rounds, ``y`` bytes; Hockney, "The communication challenge for MPP",
Parallel Computing 20, 1994), plus the size headers of variable-size messages apart
(``header_messages``, ``header_bytes``). :class:`Ledger` keeps one PhaseCost per phase label and their
running total; a sub-communicator's ledger also records into its parent's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Ledger", "PhaseCost"]


@dataclass
class PhaseCost:
    """One call's (or one phase's) cost: messages, bytes each way, sequential rounds, size headers."""

    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    header_messages: int = 0
    header_bytes: int = 0

    def add(self, other: "PhaseCost") -> None:
        for name in _COST_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        """The counters as a plain dict (``dataclasses.asdict`` without its deep copies: the ledger
        is read before and after every reduce, on the communication thread's critical path)."""
        return {name: getattr(self, name) for name in _COST_FIELDS}


_COST_FIELDS = tuple(f.name for f in fields(PhaseCost))


class Ledger:
    """Per-rank record of messages, sequential rounds and bytes, keyed by a phase label.

    The totals (``ledger.bytes_sent`` etc.) sum over phases; ``ledger.phases[label]`` holds one
    phase. Algorithms set the label with ``with comm.phase("reduce-scatter"): ...``.
    """

    def __init__(self, parent: "Ledger | None" = None) -> None:
        self.phases: dict[str, PhaseCost] = {}
        self.label = "default"
        self._total = PhaseCost()  # kept with every record: the totals are read around every reduce
        self.parent = parent  # a sub-communicator's ledger also records into its parent's (Comm.split)

    def record(self, cost: PhaseCost) -> None:
        self.phases.setdefault(self.label, PhaseCost()).add(cost)
        self._total.add(cost)
        if self.parent is not None:
            self.parent.record(cost)

    def total(self) -> PhaseCost:
        """The sum over phases (a copy)."""
        return PhaseCost(**self._total.as_dict())

    def __getattr__(self, name):  # totals: messages_sent, bytes_sent, bytes_received, rounds, ...
        if name in _COST_FIELDS:
            return getattr(self._total, name)
        raise AttributeError(name)

    def snapshot(self) -> dict:
        """Totals as a plain dict (cheap to compare before/after a call)."""
        return self._total.as_dict()

    def since(self, snap: dict) -> dict:
        now = self.snapshot()
        return {k: now[k] - snap.get(k, 0) for k in now}

    def reset(self) -> None:
        self.phases.clear()
        self._total = PhaseCost()

    def __repr__(self) -> str:
        return f"Ledger({self.snapshot()}, phases={list(self.phases)})"
