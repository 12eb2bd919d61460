"""Reducer: the stateful, lossy gradient exchange every method implements, and its declared capabilities.

``out = r.reduce(grad)`` takes this rank's 1-D gradient and returns the SUM over ranks of what was
transmitted, as a dense tensor bitwise identical on every rank. What was not transmitted stays in
the reducer's error-feedback memory (``r.memory``, :class:`~.memory.ErrorFeedback`; its residual is
``r.residual``) and is added to the next gradient. Averaging happens once, in the trainer. For a
conserving reducer the identity

    sum_r (grad_r + residual_before_r) == out + sum_r residual_after_r

holds every step (Stich et al., "Sparsified SGD with Memory", NeurIPS 2018). With momentum
correction (:mod:`sparsync.convergence`) the reducer is fed the velocity instead, and the same
identity holds with it in place of ``grad_r``.

A subclass implements :meth:`_reduce` (selection, ``self.memory``, communication) and, if it has
state beyond the residual and step counter, :meth:`_extra_state` / :meth:`_load_extra_state`. It
times its stages with ``self.timed("select")`` / ``self.timed("comm")`` and reports what it
transmitted with ``self.stats["selected"] = ...``; bytes, messages and rounds come from the ledger.

Capabilities are declared, not discovered: every class attribute named in :data:`CAPABILITIES` is a
``bool`` with a default here, and :func:`check_capabilities` holds every registered class to it
(``has_memory``, ``accepts_fold``, ``indexed_output``, ``sparse_input``, ``checks_input``,
``conserving``, ``supports_value_dtype``, ``value_dtype_conserving``, ``reuse_buffers``). They are
facts of the class, never assigned on an instance; one that a constructor option decides is an
:class:`~.capabilities.OptionFact` (the class reads the default instance's ``bool``, an instance its
options' answer). Callers (the overlap engine, the convergence policy) read them as attributes.

Non-finite input, one policy for every reducer: ``nonfinite="error"`` (default) makes :meth:`reduce`
raise ``FloatingPointError`` naming the rank and step before anything is sent or absorbed into the
residual; ``nonfinite="ignore"`` skips the check (the caller guarantees finite input). A reducer with
``checks_input = True`` checks inside its first pass over the input (:func:`~.memory.sum_checked`:
``grad + residual`` and the test of every entry in one pass); every other one pays one read pass
(:func:`~.memory.sums_finite`). Raising on one rank makes the others wait in their next collective:
``run_local`` / ``sparsync train`` then stop every rank at once.

The first call also checks, in one small all-gather, that every rank passes the same numel, dtype
and density: a mismatch names the ranks and values instead of failing later on byte counts.

:meth:`Reducer.zeros_output` returns a zero-filled tensor for the dense result that is recycled from
an earlier step once nothing outside the reducer references its memory any more (checked on the
storage's reference count, so views held by the caller count), and is a fresh allocation otherwise:
the caller sees no difference, and a tensor the caller still holds is never reused.
"""

from __future__ import annotations

import contextlib
import struct
import time
from typing import NamedTuple

import torch

from ..recycle import recycled
from ..select.topk import check_density
from ..sparse import set_at
from .capabilities import CAPABILITIES, OptionFact, wire_conserves
from .memory import ErrorFeedback, cpu_copy, nonfinite_sum_count, round_to_wire, sum_checked, sums_finite
from .resume import load_reducer_state

__all__ = ["Reducer", "IndexedSum", "CAPABILITIES", "NONFINITE_POLICIES", "VALUE_DTYPES", "check_capabilities"]

NONFINITE_POLICIES = ("error", "ignore")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # codes for the set-up check
#: ``value_dtype`` option -> dtype of the transmitted values (None: the gradient's own dtype)
VALUE_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class IndexedSum(NamedTuple):
    """A sum over ranks given by its non-zeros: sorted unique int64 ``indices`` into a vector of
    ``numel`` entries and their ``values`` (the same on every rank); every other entry is zero."""

    indices: torch.Tensor
    values: torch.Tensor
    numel: int


class Reducer:
    name = "base"
    #: True when the reducer keeps error feedback: ``self.memory`` is an :class:`~.memory.ErrorFeedback`
    #: (``residual`` its residual); False: ``memory`` is None and ``residual`` always None
    has_memory = True
    #: True when the memory accumulates in place (with ``reuse_buffers``), so a caller that computes
    #: the input in a pass of its own may fold it into ``memory.fold_target(...)`` (momentum correction)
    accepts_fold = False
    #: True when :meth:`_reduce` returns an :class:`IndexedSum` (see :meth:`reduce`'s ``indexed``)
    indexed_output = False
    #: True when :meth:`reduce_sparse` takes a torch sparse COO gradient (embedding tables)
    sparse_input = False
    #: True for reducers whose :meth:`_reduce` checks its input itself before it sends anything (fused
    #: into its first pass: :meth:`sum_checked`, the memory's ``add``): :meth:`reduce` then makes no
    #: check pass of its own
    checks_input = False
    #: True when the conservation identity holds exactly (up to fp rounding) every step; an instance
    #: with ``value_dtype`` fp16/bf16 and ``value_dtype_conserving`` False does not conserve.
    conserving = OptionFact(True, wire_conserves)
    #: True for reducers whose wire carries values as ``value_dtype`` (fp16/bf16): the values are
    #: rounded before sending (:meth:`wire_values`), the rounding error stays in the residual, and the
    #: receivers sum in fp32, so conservation holds as before.
    supports_value_dtype = False
    #: False for reducers that sum the half-precision values themselves in a dense all-reduce
    #: (:meth:`allreduce_wire_values`): that sum rounds outside any residual, so an instance with
    #: ``value_dtype`` fp16/bf16 does not conserve (:func:`~.capabilities.wire_conserves`).
    value_dtype_conserving = True
    #: True: recycle gradient-sized buffers across steps (the dense output; with ``accepts_fold`` the
    #: memory's accumulator too). Reducers with a ``reuse_buffers`` option declare an ``OptionFact``.
    reuse_buffers = True

    def __init__(self, comm, density: float = 0.01, value_dtype: str = "fp32", nonfinite: str = "error",
                 **options):
        if options:  # what no subclass consumed
            self.check_options(options, _unknown=options)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {', '.join(VALUE_DTYPES)}, got {value_dtype!r}")
        if VALUE_DTYPES[value_dtype] is not None and not self.supports_value_dtype:
            raise ValueError(f"reducer {self.name!r} does not support value_dtype={value_dtype!r} yet "
                             "(its wire or its summation is not half-precision aware; see docs/sparcml.md)")
        self.wire_dtype = VALUE_DTYPES[value_dtype]
        self.comm = comm
        self.nonfinite = nonfinite
        self.density = check_density(density)
        self.memory: ErrorFeedback | None = None
        if self.has_memory:
            self.memory = ErrorFeedback(in_place=self.accepts_fold and self.reuse_buffers, wire_dtype=self.wire_dtype,
                                        on_nonfinite=self._nonfinite_handler())
        self.step = 0
        self.numel: int | None = None
        self.stats: dict = {}

    @classmethod
    def option_names(cls) -> list[str]:
        """The keyword options ``make_reducer(name, comm, density, **options)`` accepts: the named
        parameters of every ``__init__`` along the MRO (subclasses pass the rest up with ``**rest``)."""
        import inspect

        names = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is object:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "comm", "density"):
                    names.add(p.name)
        return sorted(names)

    @classmethod
    def check_options(cls, options: dict, _unknown=None) -> None:
        """TypeError naming the unknown keys of ``options`` and the valid ones (before any work)."""
        valid = cls.option_names()
        unknown = sorted(_unknown if _unknown is not None else set(options) - set(valid))
        if unknown:
            raise TypeError(f"reducer {cls.name!r} got unknown options: {', '.join(unknown)}; "
                            f"valid: {', '.join(valid) or '(none)'}")

    # ------------------------------------------------------------------ public API
    @property
    def residual(self) -> torch.Tensor | None:
        """This rank's error-feedback memory (1-D, the gradient's numel), or None."""
        return None if self.memory is None else self.memory.residual

    @residual.setter
    def residual(self, value: torch.Tensor | None) -> None:
        if self.memory is None and value is not None:
            raise ValueError(f"reducer {self.name!r} keeps no residual (has_memory = False)")
        if self.memory is not None:
            self.memory.residual = value

    def reduce_sparse(self, grad: torch.Tensor) -> torch.Tensor:
        """SUM over ranks of a torch sparse COO gradient (reducers with ``sparse_input = True``)."""
        raise TypeError(f"reducer {self.name!r} takes no sparse gradients (sparse_input = False)")

    #: this call's ``donate`` (set by :meth:`_begin`; read by ``_reduce`` / ``_start``)
    donated = False

    def reduce(self, grad: torch.Tensor, *, indexed: bool = False, donate: bool = False) -> torch.Tensor | IndexedSum:
        """This step's sum over ranks (see the module docstring). ``indexed=True``: a reducer whose
        ``indexed_output`` is True returns it as an :class:`IndexedSum` (its non-zeros only), so the
        caller can write it without a pass over the dense vector (``SparseDDP`` does); every other
        reducer returns the dense tensor either way. ``donate=True``: the caller hands ``grad`` over
        (it reads it no more and lets it be overwritten), so a reducer that would first copy it may
        reduce it in place and return it - ``dense`` does, the same bits without the copy pass
        (``SparseDDP`` donates its own gradient buffers)."""
        grad, snap, t0 = self._begin(grad, donate)
        with self.comm.phase(self.name):
            out = self._reduce(grad)
            if isinstance(out, IndexedSum) and not indexed:
                out = self._densify(out)
        self._sync()
        self._account(self.comm.ledger.since(snap), t0)
        return out

    #: True when a step's exchange is ONE collective that :meth:`start` posts without waiting (``dense``). Several
    #: stay False: posted from callbacks, they could be issued in another order on another rank (gloo pairs by order).
    staged = False
    #: the caller's ``time.perf_counter()`` when this step's compute began (``SparseDDP`` sets it: backward's start)
    compute_start: float | None = None

    def start(self, grad: torch.Tensor, *, donate: bool = False) -> torch.futures.Future:
        """:meth:`reduce` with its one collective posted, not waited for (``staged`` reducers): local
        work and the ledger now; a ``torch.futures.Future`` of :meth:`reduce`'s result, bit for bit (a
        failed collective: its exception); ``stats`` and ``step`` when it completes. One call in flight.
        ``donate``: as for :meth:`reduce` (``grad`` is then reduced in place and is the result)."""
        if not self.staged:
            raise TypeError(f"reducer {self.name!r} is not staged (several dependent collectives): call reduce()")
        grad, snap, t0 = self._begin(grad, donate)
        with self.comm.phase(self.name):
            fut = self._start(grad)
        cost = self.comm.ledger.since(snap)
        posted = time.perf_counter()

        def done(f):
            out = f.value()
            self._sync()
            self.stats["comm_s"] = self.stats.get("comm_s", 0.0) + time.perf_counter() - posted
            self._account(cost, t0)
            return out

        return fut.then(done)

    def _begin(self, grad: torch.Tensor, donate: bool = False):
        """The opening of :meth:`reduce` / :meth:`start`: ``(grad checked, ledger snapshot, start time)``."""
        self.donated = bool(donate)
        grad = self._validate(grad)
        if not self.checks_input:
            self.check_finite(grad)
        self.stats = {"select_s": 0.0, "comm_s": 0.0}
        return grad, self.comm.ledger.snapshot(), time.perf_counter()

    def _account(self, cost: dict, t0: float) -> None:
        """The close of :meth:`reduce` / :meth:`start`: ``stats`` from this call's ledger ``cost``; step + 1."""
        selected = self.stats.get("selected", self.numel)
        self.stats.update(
            selected=int(selected),
            density=float(selected) / max(1, self.numel),
            target_density=self.density,
            bytes_sent=cost["bytes_sent"],
            bytes_received=cost["bytes_received"],
            messages=cost["messages_sent"],
            rounds=cost["rounds"],
            total_s=time.perf_counter() - t0,
        )
        self.step += 1

    def state_dict(self) -> dict:
        """Everything needed to resume bitwise: residual, step, and the method's own state."""
        return {
            "name": self.name,
            "step": self.step,
            "numel": self.numel,
            "density": self.density,
            "residual": cpu_copy(self.residual),
            "extra": self._extra_state(),
            "rank": self.comm.rank,  # the residual is this rank's (sparsync.rankstate)
            "world_size": self.comm.world_size,
        }

    def load_state_dict(self, d: dict) -> None:
        """Load :meth:`state_dict`'s result, checked whole first (:mod:`.resume`: a one-line
        ``ValueError`` and nothing changed; another rank's state is refused); a state from another
        world size loads its residual only, the rest of the method starting fresh."""
        load_reducer_state(self, d)

    @classmethod
    def predicted_cost(cls, P: int, n: int, k: int, value_bytes: int = 4, index_bytes: int = 4, **options):
        """The document's alpha-beta cost per rank: ``{"rounds": .., "bytes_received": ..}``.

        Values are numbers, or ``(low, high)`` pairs where the document gives bounds. ``None`` when
        the method has no formula. Used by the ledger tests and by the simulator.
        """
        return None

    # ------------------------------------------------------------------ for subclasses
    def _reduce(self, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _start(self, grad: torch.Tensor) -> torch.futures.Future:  # staged: _reduce, its collective posted
        raise NotImplementedError

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, d: dict) -> None:
        pass

    def _check_extra_state(self, d: dict, numel: int | None) -> None:
        """Raise a one-line ``ValueError`` when :meth:`_load_extra_state` cannot take ``d`` (a state
        of this world size, for a gradient of ``numel`` entries); called before anything changes."""

    @property
    def k(self) -> int:
        """Entries this rank may transmit: ``max(1, round(density * numel))``."""
        return min(self.numel, max(1, int(round(self.density * self.numel))))

    @contextlib.contextmanager
    def timed(self, key: str):
        """Add the block's wall time (device-synchronised) to ``stats[key + '_s']``."""
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            k = key + "_s"
            self.stats[k] = self.stats.get(k, 0.0) + time.perf_counter() - t0

    def wire_values(self, vals: torch.Tensor) -> torch.Tensor:
        """The values as they travel: rounded to ``value_dtype`` (fp16 saturates at +-65504), or
        unchanged for fp32. Pass the result to ``memory.keep`` so the rounding error stays."""
        return round_to_wire(vals, self.wire_dtype)

    def allreduce_wire_values(self, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sent, sum over ranks) of values every rank holds at the same indices (MiCRO, CLT-k).

        ``sent`` = :meth:`wire_values` (give it to ``memory.keep``); the sum is the ring
        all-reduce of ``sent`` - in half precision with ``value_dtype`` fp16/bf16 (half the bytes;
        the cross-rank rounding is not in any residual, hence ``value_dtype_conserving = False``;
        summing in fp32 would need an all-gather, ``(P-1)*2`` instead of ``2(P-1)/P*2`` bytes per
        value) - returned in ``vals``' dtype."""
        sent = self.wire_values(vals)
        return sent, self.comm.allreduce(sent).to(vals.dtype)

    @property
    def scratch(self) -> dict:
        """Selection workspaces kept across steps (``sparsync.select.exact.scratch_buffer``)."""
        return self.__dict__.setdefault("_scratch", {})

    #: how many earlier outputs :meth:`zeros_output` keeps for recycling (the caller typically
    #: still holds the previous one while the next step runs, so 2)
    output_pool_size = 2

    def _densify(self, out: IndexedSum) -> torch.Tensor:
        """The dense tensor of an :class:`IndexedSum` (a recycled zero-filled output buffer unless
        ``reuse_buffers`` is off): a streaming zero fill and a scatter of the sorted indices."""
        if self.reuse_buffers:
            dense = self.zeros_output(out.numel, out.values.dtype, out.values.device)
        else:
            dense = torch.zeros(out.numel, dtype=out.values.dtype, device=out.values.device)
        return set_at(dense, out.indices, out.values)

    def zeros_output(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A zero-filled 1-D tensor for this step's dense result (see the module docstring).

        A pooled buffer is reused only when its storage has no reference outside the pool: the
        caller always gets an alias (``buf.view(-1)``), so while it - or any view of it - is alive
        the storage count is above the pool's own. Any in-place change the caller made is wiped by
        the full ``zero_()``.
        """
        return self.output_buffer(numel, dtype, device, zero=True)

    def output_buffer(self, numel: int, dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
        """:meth:`zeros_output` without the zero fill (``zero=False``): for a result that is fully
        overwritten (the dense reducer copies the gradient in and all-reduces in place)."""
        pool = self.__dict__.setdefault("_output_pool", [])  # [(buffer, its own storage count)]
        return recycled(pool, numel, dtype, device, zero=zero, keep=self.output_pool_size)

    def check_finite(self, values: torch.Tensor) -> None:
        """Raise FloatingPointError (rank and step named) on NaN/Inf, unless ``nonfinite="ignore"``;
        one read pass (:func:`~.memory.sums_finite`)."""
        if self.nonfinite != "ignore" and not sums_finite(values):
            self._raise_nonfinite(values)

    def _nonfinite_handler(self):
        """The input check handed to :func:`~.memory.sum_checked` (None with ``nonfinite="ignore"``)."""
        return None if self.nonfinite == "ignore" else self._raise_nonfinite

    def _raise_nonfinite(self, values: torch.Tensor, residual: torch.Tensor | None = None):
        """Raise for non-finite input ``values``; when they are finite, ``values + residual`` is what
        overflowed: the error-feedback residual, named as such."""
        nan = int(torch.isnan(values).sum())
        inf = int(torch.isinf(values).sum())
        if nan == 0 and inf == 0 and residual is not None:
            bad = nonfinite_sum_count(values, residual)
            raise FloatingPointError(
                f"rank {self.comm.rank}: {self.name}.reduce: the error-feedback residual overflowed at step "
                f"{self.step}: gradient + residual is Inf/NaN in {bad} of {values.numel()} entries although the "
                f"gradient is finite (largest residual entry {float(residual.abs().max()):.3g}); nothing was sent. "
                "Lower the learning rate or clip the gradient")
        raise FloatingPointError(
            f"rank {self.comm.rank}: {self.name}.reduce got a non-finite gradient at step {self.step} "
            f"({nan} NaN, {inf} Inf of {values.numel()}); nothing was sent. Lower the learning rate or "
            f"find the NaN's source; pass nonfinite='ignore' only if the input is checked elsewhere")

    def sum_checked(self, out: torch.Tensor, grad: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """``out = grad + residual`` (``residual=None``: a copy of ``grad``) with this reducer's input
        check fused into the same pass (:func:`~.memory.sum_checked`; ``out`` must not overlap
        ``grad`` or ``residual``: on non-finite input it raises before anything is sent, and neither
        has changed)."""
        return sum_checked(out, grad, residual, self._nonfinite_handler())

    # ------------------------------------------------------------------ internals
    def _sync(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)

    def _validate(self, grad) -> torch.Tensor:
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"{self.name}.reduce needs a tensor, got {type(grad).__name__}")
        if grad.dim() != 1:
            raise ValueError(f"{self.name}.reduce needs a 1-D gradient (flatten it), got shape {tuple(grad.shape)}")
        if not grad.dtype.is_floating_point:
            raise TypeError(f"{self.name}.reduce needs a floating-point gradient, got {grad.dtype}")
        if grad.numel() == 0:
            raise ValueError(f"{self.name}.reduce needs a non-empty gradient, got 0 elements")
        if self.numel is None:
            self._check_setup_same(grad)
            if self.residual is not None and self.residual.numel() != grad.numel():  # a resumed state's
                raise ValueError(f"{self.name}.reduce: gradient has {grad.numel()} elements, the loaded "
                                 f"residual {self.residual.numel()}")
            self.numel = grad.numel()
        elif grad.numel() != self.numel:
            raise ValueError(f"{self.name}.reduce: gradient has {grad.numel()} elements, "
                             f"this reducer was set up with {self.numel}")
        return grad.contiguous()

    def _check_setup_same(self, grad: torch.Tensor) -> None:
        """First call: every rank must pass the same numel and dtype and use the same density; one
        all-gather of three integers, and a message that names the mismatch and the ranks."""
        code = _DTYPES.index(grad.dtype) if grad.dtype in _DTYPES else len(_DTYPES)
        bits = struct.unpack("<q", struct.pack("<d", float(self.density)))[0]
        mine = torch.tensor([grad.numel(), code, bits], dtype=torch.int64, device=self.comm.device)
        rows = [[int(v) for v in t.reshape(-1).tolist()] for t in self.comm.allgather_control(mine)]
        show = {0: lambda v: str(v),
                1: lambda v: str(_DTYPES[v]).replace("torch.", "") if v < len(_DTYPES) else "other",
                2: lambda v: f"{struct.unpack('<d', struct.pack('<q', v))[0]:g}"}
        for i, what in enumerate(("gradient numel", "gradient dtype", "density")):
            vals = [row[i] for row in rows]
            if len(set(vals)) > 1:
                raise ValueError(f"rank {self.comm.rank}: {self.name}.reduce: {what} differs across ranks: "
                                 + ", ".join(f"rank {r}: {show[i](v)}" for r, v in enumerate(vals)))


def check_capabilities(cls) -> None:
    """TypeError unless ``cls`` declares every capability of :data:`CAPABILITIES` as a ``bool``,
    ``sparse_input`` exactly when it overrides :meth:`Reducer.reduce_sparse`, and ``accepts_fold``
    only with ``has_memory`` (called by :func:`~.registry.register`, so at import)."""
    if not (isinstance(cls, type) and issubclass(cls, Reducer)):
        raise TypeError(f"a reducer must be a subclass of sparsync.reducers.base.Reducer, got {cls!r}")
    for cap in CAPABILITIES:
        v = getattr(cls, cap)
        if not isinstance(v, bool):
            raise TypeError(f"reducer {cls.__name__}: capability {cap} must be a bool, got {v!r}")
    if cls.sparse_input != (cls.reduce_sparse is not Reducer.reduce_sparse):
        raise TypeError(f"reducer {cls.__name__}: sparse_input = {cls.sparse_input} but reduce_sparse is "
                        f"{'' if cls.sparse_input else 'not '}the base class's")
    if cls.accepts_fold and not cls.has_memory:
        raise TypeError(f"reducer {cls.__name__}: accepts_fold needs has_memory")
