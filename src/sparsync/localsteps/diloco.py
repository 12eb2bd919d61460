"""DiLoCo: local steps of an inner optimizer, then an outer optimizer step on the reduced pseudo-gradient.

::

    dl = ss.DiLoCo(model, comm, torch.optim.AdamW(model.parameters()), sync_every=16)   # dense
    dl = ss.DiLoCo(model, comm, opt, sync_every=16, reducer="micro", density=0.02)      # sparse
    dl = ss.DiLoCo(model, comm, opt, sync_every=16,                                     # any outer optimizer
                   outer_optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward()
        dl.step()                      # where opt.step() was: inner step, every H calls the outer sync

Every rank runs ``sync_every`` (H) steps of its own ``inner_optimizer`` on its own data, without any
communication (``sync_every="auto"``: H chosen at every synchronisation from the measured times,
:mod:`.period`). Every H-th call of :meth:`DiLoCo.step` then

1. forms the pseudo-gradient ``delta_r = shared - local_r`` (the shared parameters of the last
   synchronisation minus this rank's parameters now), one flat buffer per (device, dtype);
2. reduces it with a sparsync reducer (``make_reducer(reducer, comm, density, **reducer_options)``):
   ``dense`` is an all-reduce (DiLoCo, Douillard et al. 2023); any sparsifying reducer sends only
   part of it and keeps the rest in its residual, which is added to the next outer step's
   pseudo-gradient (error feedback across outer steps: SparseLoCo, Sarfi et al. 2025). A reducer
   that can send its values in half precision does so unless ``value_dtype`` is given (the
   rounding stays in its residual, so the exchange stays conserving);
3. divides the sum by the world size P, sets the module's parameters to the shared ones and each
   parameter's ``.grad`` to its part of that average, and calls ``outer_optimizer.step()`` (the
   convention of torchft's DiLoCo: the outer optimizer is an ordinary torch optimizer over the
   module's parameters). The default is DiLoCo's ``torch.optim.SGD(lr=0.7, momentum=0.9,
   nesterov=True)`` under an SGD inner optimizer and plain averaging (lr 1, no momentum) under Adam /
   AdamW - with ``sparseloco`` there, lr = P: the sum of the ranks' sent parts (``outer_lr`` /
   ``outer_momentum`` change it; ``outer_momentum=0``: plain SGD);
4. the parameters it produced become the new shared parameters (copied into the flat buffers); the
   module keeps them as its parameters. The parameters' ``.grad`` are put back to what they were
   before the outer step (the inner optimizer's gradients, untouched).

The reducer's sum is bitwise identical on every rank (the reducer contract), so - the outer
optimizer being deterministic and starting from the same state everywhere - the shared parameters,
the outer optimizer's state and hence every rank's parameters after an outer step are bitwise
identical. With H = 1, ``outer_lr=1``, ``outer_momentum=0``, an inner SGD without momentum and the
dense reducer this is synchronous data-parallel SGD (``delta_r = lr g_r``, up to float rounding of
``shared - (shared - lr g_r)``). With ``outer_lr=1``, ``outer_momentum=0`` and the dense reducer it is
local SGD / model averaging every H steps (Lin et al. 2020, "Don't use large mini-batches, use local
SGD"; torch's ``PeriodicModelAverager``).

State (:meth:`state_dict` / :meth:`load_state_dict`; tensors and plain data, no process group):
the world size and rank it was saved at, the shared parameters, the outer optimizer's
``state_dict()`` (momentum buffer, Adam's moments, ...), the inner step counter within the current
cycle, the outer step count, with ``sync_every="auto"`` the period and its measurements, and every
reducer's state (residual included). To resume bitwise - also from a checkpoint taken in the middle
of an outer cycle - save, on every rank, the module's parameters (``model.state_dict()``: the local
parameters of this rank), the inner optimizer's ``state_dict()`` and this object's ``state_dict()``;
load all three before the next step. :meth:`load_state_dict` checks the whole state before it
changes anything; a state of another world size or another rank is refused (the residuals are per
rank, the pseudo-gradients and the outer step per world). Module buffers (e.g. BatchNorm
statistics) are broadcast from rank 0 at construction and stay local afterwards.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from .overlap import Overlap, check_overlap
from .outer import V1, check_optimizer_state, check_outer_optimizer, default_outer, nonneg_int, outer_state_from_v1
from .period import MAX_PERIOD, AutoPeriod, default_period_cost

__all__ = ["DiLoCo", "STATE_FORMAT", "default_reducer_options"]

STATE_FORMAT = "sparsync-diloco/2"
#: the format before the outer optimizer stepped the module's parameters: the default SGD's momentum
#: over the flat shared buffers, no world size or rank (loaded with the default outer optimizer)
STATE_FORMAT_V1 = V1


def default_reducer_options(reducer: str, options: dict) -> dict:
    """``options`` plus ``value_dtype="fp16"`` where the reducer can send half-precision values and
    stay conserving (the rounding kept in its residual) and ``options`` name no ``value_dtype``.
    An unknown reducer name raises, listing the valid ones."""
    from ..reducers.registry import REDUCERS

    cls = REDUCERS.lookup(reducer)
    if "value_dtype" not in options and cls.supports_value_dtype and cls.value_dtype_conserving:
        return {**options, "value_dtype": "fp16"}
    return dict(options)


class _Group:
    """The trainable parameters of one (device, dtype): a flat copy of their shared values, a
    pseudo-gradient buffer of the same size, and the reducer that exchanges it."""

    def __init__(self, params: list[torch.Tensor], reducer):
        self.params = params
        self.sizes = [p.numel() for p in params]
        with torch.no_grad():
            self.shared = torch.cat([p.detach().reshape(-1) for p in params])
        self.pseudo = torch.empty_like(self.shared)
        self.average = torch.empty_like(self.shared)  # the outer gradient (recycled: no page faults per sync)
        self.reducer = reducer

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, self.sizes))

    def pseudo_gradient(self) -> torch.Tensor:
        """``shared - local`` in one pass per parameter, written into the group's own buffer."""
        for p, s, d in zip(self.params, self.views(self.shared), self.views(self.pseudo)):
            torch.sub(s, p.detach().reshape(-1), out=d)
        return self.pseudo

    def write_back(self) -> None:
        """Set the module's parameters to the shared ones."""
        for p, s in zip(self.params, self.views(self.shared)):
            p.detach().copy_(s.view_as(p))

    def read_back(self, into: torch.Tensor | None = None) -> None:
        """Copy the module's parameters into the flat ``into`` (default: the shared parameters)."""
        for p, s in zip(self.params, self.views(self.shared if into is None else into)):
            s.copy_(p.detach().reshape(-1))

    def set_grads(self) -> None:
        """Every parameter's ``.grad``: its part of the averaged pseudo-gradient (a view of ``average``)."""
        for p, a in zip(self.params, self.views(self.average)):
            p.grad = a.view_as(p)


class DiLoCo:
    """Local steps with an outer synchronisation every ``sync_every`` steps (see the module docstring).

    Args:
        module: the model; its trainable parameters are synchronised (every rank must have the same
            ones: count, shapes, dtypes; checked at construction).
        comm: a :class:`sparsync.Comm`, a torch process group, or None for the default group.
        inner_optimizer: any ``torch.optim.Optimizer`` over the module's parameters (SGD, AdamW...).
        sync_every: H, the number of :meth:`step` calls per outer synchronisation (>= 1), or ``"auto"``:
            chosen at every synchronisation from the measured step and synchronisation times and the
            convergence cost of local steps (:mod:`.period`; options ``period_cost``, default per the
            inner optimizer's family, and ``max_period``, default 64); ``sync_every`` then holds the
            current period and ``periods`` every choice.
        reducer: a registered sparsync reducer for the pseudo-gradient (``"dense"``, ``"micro"``,
            ``"topka"``, ...; see ``ss.make_reducer``).
        density: the fraction of pseudo-gradient entries a sparsifying reducer sends per outer step.
        outer_lr, outer_momentum: the default outer optimizer, ``torch.optim.SGD`` over the module's
            trainable parameters with ``nesterov=outer_momentum > 0``. Defaults by the inner optimizer:
            0.7 and 0.9 (the DiLoCo paper's) for SGD; 1 and 0 - plain averaging - for Adam / AdamW, where
            outer momentum measurably diverges (:data:`~.outer.DEFAULT_OUTER`); with
            ``reducer="sparseloco"`` under Adam / AdamW, lr = world size and 0: the sum of the ranks' sent
            parts, not their mean (:func:`~.outer.default_outer`). Not together with ``outer_optimizer``.
        outer_optimizer: any ``torch.optim.Optimizer`` whose param groups hold exactly the module's
            trainable parameters (checked before anything is set up), stepped once per outer
            synchronisation with the averaged pseudo-gradient as the parameters' ``.grad`` on the
            shared parameters (torchft's convention). Its state must start the same on every rank
            (a freshly built optimizer does); it is in :meth:`state_dict`. Learning-rate schedulers
            may drive it (one scheduler step per outer step is the caller's).
        init_sync: broadcast rank 0's parameters and buffers at construction (default True), so
            every rank starts from the same shared parameters.
        overlap: 0 (default): every rank waits for the exchange at the end of each period; tau in
            [1, H]: the exchange runs in the background during the next tau inner steps and the outer step is
            applied after them, each rank's progress since kept (:mod:`.overlap`; not with ``"auto"``; a
            reducer of one collective: ``dense``, ``sparseloco``).
        **reducer_options: passed to the reducer (``value_dtype="fp32"`` turns half-precision values off).

    After each call of :meth:`step`, ``last_stats`` holds ``synced`` (whether this call ran the
    outer synchronisation), ``outer_step``, ``sync_every`` (the period in force), and for the
    synchronisation the reducer's ``select_s``,
    ``comm_s``, ``bytes_sent``, ``bytes_received``, ``selected``, ``density`` plus ``inner_s`` and
    ``outer_s`` (seconds of the inner step and of the whole outer synchronisation); calls without
    synchronisation report zero bytes and zero density. With ``overlap``, ``synced`` marks the call that
    applied an outer step (its exchange's stats, ``wait_s`` the seconds it waited for it), ``launched``
    the call that started one, and ``outer_s`` the seconds either spent on the caller's thread.
    """

    def __init__(self, module: nn.Module, comm, inner_optimizer, sync_every: int, reducer: str = "dense",
                 density: float = 0.01, outer_lr: float | None = None, outer_momentum: float | None = None, *,
                 outer_optimizer: torch.optim.Optimizer | None = None, init_sync: bool = True,
                 period_cost: float | None = None, max_period: int = MAX_PERIOD, overlap: int = 0,
                 **reducer_options):
        from ..ddp import start_in_sync
        from ..reducers.registry import make_reducer
        from ..torchcomm import as_comm as _as_comm

        if not isinstance(module, nn.Module):
            raise TypeError(f"DiLoCo wraps an nn.Module, got {type(module).__name__}")
        if not callable(getattr(inner_optimizer, "step", None)):
            raise TypeError(f"inner_optimizer must be an optimizer with .step(), got {type(inner_optimizer).__name__}")
        auto = sync_every == "auto"
        if not auto and (isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"sync_every must be a positive integer or 'auto', got {sync_every!r}")
        if not auto and period_cost is not None:
            raise ValueError("period_cost applies to sync_every='auto' only")
        self.overlap = Overlap(check_overlap(overlap, sync_every, reducer))
        self.comm = comm = _as_comm(comm, module)
        if outer_optimizer is not None:
            given = [k for k, v in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)) if v is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} configure the default outer SGD; with outer_optimizer "
                                 "set them on that optimizer")
            check_outer_optimizer(outer_optimizer, [p for p in module.parameters() if p.requires_grad],
                                   inner_optimizer)
        else:
            lr0, mom0 = default_outer(type(inner_optimizer).__name__, reducer, comm.world_size)
            outer_lr = lr0 if outer_lr is None else outer_lr
            outer_momentum = mom0 if outer_momentum is None else outer_momentum
            if not (float(outer_lr) > 0):
                raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
            if not (0 <= float(outer_momentum) < 1):
                raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        reducer_options = default_reducer_options(reducer, reducer_options)
        self.module = module
        self.inner_optimizer = inner_optimizer
        cost = default_period_cost(inner_optimizer) if period_cost is None else period_cost
        self.auto_period = AutoPeriod(self.comm, cost, max_period) if auto else None  # (checks its options)
        self.sync_every = self.auto_period.period if auto else int(sync_every)
        # the default outer SGD's lr and momentum; None with a caller's outer_optimizer
        self.outer_lr = None if outer_optimizer is not None else float(outer_lr)
        self.outer_momentum = None if outer_optimizer is not None else float(outer_momentum)
        self.reducer_name = reducer
        named = start_in_sync(module, comm, "DiLoCo", init_sync)
        by_kind: dict = {}
        for _, p in named:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        # with overlap the exchange has a process group of its own (it runs beside the caller's collectives)
        on = comm.split([list(range(comm.world_size))]) if self.overlap.steps else comm
        self.groups = [_Group(ps, make_reducer(reducer, on, density=density, **reducer_options))
                       for ps in by_kind.values()]
        if outer_optimizer is None:
            mom = self.outer_momentum
            outer_optimizer = torch.optim.SGD([p for _, p in named], lr=self.outer_lr, momentum=mom, nesterov=mom > 0)
            self._default_outer = True
        else:
            self._default_outer = False
        self.outer_optimizer = outer_optimizer
        self.inner_step = 0   # inner steps taken since the last outer synchronisation
        self.outer_step = 0   # outer synchronisations so far
        self.last_stats: dict = {}
        self._last_end: float | None = None  # the end of the previous step() call (a local step's compute since)

    @property
    def periods(self) -> list[dict]:
        """``sync_every="auto"``: every choice (outer step, period, the times it came from); else []."""
        return [] if self.auto_period is None else list(self.auto_period.history)

    @property
    def reducers(self) -> list:
        """One reducer per parameter group (one group unless the module mixes devices or dtypes)."""
        return [g.reducer for g in self.groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad`` (so DiLoCo can stand where the optimizer stood)."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One inner step; every ``sync_every``-th call also the outer synchronisation. Returns what
        the inner optimizer's ``step`` returned."""
        t0 = time.perf_counter()
        loss = self.inner_optimizer.step() if closure is None else self.inner_optimizer.step(closure)
        t1 = time.perf_counter()
        if self.auto_period is not None and self._last_end is not None:
            self.auto_period.step(t1 - self._last_end)  # forward, backward and inner step since the last call
        self.inner_step += 1
        period = self.sync_every
        self.last_stats = {"synced": False, "outer_step": self.outer_step, "outer_s": 0.0,
                           "select_s": 0.0, "comm_s": 0.0, "bytes_sent": 0, "bytes_received": 0,
                           "selected": 0, "numel": self.numel, "density": 0.0}
        if self.overlap.due():
            self._finish_overlapped()
        if self.inner_step >= self.sync_every:
            if self.overlap.steps:
                launch_s = self.overlap.launch(self.groups, self._reduce)
                self.inner_step = 0
                self.last_stats.update(launched=True, outer_s=self.last_stats["outer_s"] + launch_s)
            else:
                self.sync()
                if self.auto_period is not None:
                    self.sync_every = self.auto_period.choose(self.last_stats["outer_s"], self.outer_step)
        self.last_stats.update(inner_s=t1 - t0, sync_every=period)
        self._last_end = time.perf_counter()
        return loss

    @property
    def in_sync(self) -> bool:
        """Whether every rank holds the same parameters now: right after an outer step applied with no
        inner step since and no exchange in flight."""
        return self.inner_step == 0 and self.overlap.pending is None

    def flush(self) -> bool:
        """Apply an exchange still in flight now (``overlap``), e.g. after the last step; False when none was."""
        if self.overlap.pending is None:
            return False
        self._finish_overlapped()
        return True

    def _finish_overlapped(self) -> None:
        t0 = time.perf_counter()
        stats, wait_s = self.overlap.finish(self.groups, self._outer_step)
        self.outer_step += 1
        self.last_stats.update(synced=True, outer_step=self.outer_step, wait_s=wait_s,
                               outer_s=self.last_stats.get("outer_s", 0.0) + time.perf_counter() - t0,
                               density=stats["selected"] / max(1, self.numel), **stats)

    @property
    def numel(self) -> int:
        return sum(g.shared.numel() for g in self.groups)

    @torch.no_grad()
    def sync(self) -> None:
        """The outer synchronisation now (``step`` calls it every ``sync_every`` calls): reduce the
        pseudo-gradient, average, one outer optimizer step from the shared parameters with the average
        as ``.grad``; its result is the new shared parameters. The parameters' ``.grad`` are restored."""
        self.flush()
        t0 = time.perf_counter()
        for g in self.groups:
            g.pseudo_gradient()
        stats = self._reduce()
        self._outer_step()
        self.inner_step = 0
        self.outer_step += 1
        self.last_stats = {"synced": True, "outer_step": self.outer_step, "outer_s": time.perf_counter() - t0,
                           "numel": self.numel, "density": stats["selected"] / max(1, self.numel), **stats}

    @torch.no_grad()
    def _reduce(self, started: list | None = None) -> dict:
        """Every group's pseudo-gradient (in ``pseudo``) reduced, its mean in ``average``; the summed stats.
        ``started``: the groups' futures of ``reducer.start`` (overlap), waited for here."""
        P = self.comm.world_size
        stats = {"select_s": 0.0, "comm_s": 0.0, "bytes_sent": 0, "bytes_received": 0, "selected": 0}
        for i, g in enumerate(self.groups):
            out = g.reducer.reduce(g.pseudo) if started is None else started[i].wait()
            torch.div(out, P, out=g.average)
            for k in stats:
                stats[k] += g.reducer.stats.get(k, 0) or 0
        return stats

    @torch.no_grad()
    def _outer_step(self) -> None:
        """The outer optimizer's step from the shared parameters with ``average`` as ``.grad``; its result
        becomes the shared parameters and the module's. The parameters' ``.grad`` are restored."""
        inner_grads = [p.grad for g in self.groups for p in g.params]  # the inner optimizer's, put back below
        try:
            for g in self.groups:
                g.write_back()
                g.set_grads()
            self.outer_optimizer.step()
        finally:
            for p, grad in zip((p for g in self.groups for p in g.params), inner_grads):
                p.grad = grad
        for g in self.groups:
            g.read_back()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The world size and rank, shared parameters, the outer optimizer's ``state_dict()``, the cycle
        position and the reducers' states: tensors and plain data (no process group); the shared
        parameters and the outer optimizer's state are copies, not the live tensors. With ``overlap`` an
        exchange in flight is waited for and saved with its result (``in_flight``)."""
        in_flight = self.overlap.state_dict(self.groups)  # first: the reducers' states are final only then
        return {"format": STATE_FORMAT, "world_size": self.comm.world_size, "rank": self.comm.rank,
                "reducer": self.reducer_name, "in_flight": in_flight,
                "sync_every": "auto" if self.auto_period is not None else self.sync_every,
                "period": None if self.auto_period is None else self.auto_period.state_dict(),
                "inner_step": self.inner_step, "outer_step": self.outer_step,
                "shared": [g.shared.detach().cpu().clone() for g in self.groups],
                "outer_optimizer": copy.deepcopy(self.outer_optimizer.state_dict()),
                "reducers": [g.reducer.state_dict() for g in self.groups]}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict`'s output. The whole state is checked first - format, world size
        and rank, ``sync_every`` and reducer, the shared parameters' shapes and dtypes, the cycle
        position, the outer optimizer state's structure, every reducer's state - and any mismatch is a
        one-line ``ValueError`` with nothing changed. A state of another world size or another rank is
        refused (the residuals are per rank, the outer step per world), and so is a state of the current
        format that records neither. A state of the first format (``sparsync-diloco/1``, before the outer
        optimizer stepped the module's parameters: no world size or rank) loads as before, its flat
        outer momentum split exactly into the default SGD's per-parameter buffers; with a caller's
        ``outer_optimizer`` it is refused."""
        opt_state = self._check_state(d)
        reducers_before = [g.reducer.state_dict() for g in self.groups]
        try:
            for r, g in zip(d["reducers"], self.groups):
                g.reducer.load_state_dict(r)
            self.outer_optimizer.load_state_dict(copy.deepcopy(opt_state))  # (its own tensors, not the caller's)
        except BaseException:
            for r, g in zip(reducers_before, self.groups):
                g.reducer.load_state_dict(r)
            raise
        with torch.no_grad():
            for s, g in zip(d["shared"], self.groups):
                g.shared.copy_(s)
        self.overlap.load_state_dict(d.get("in_flight"), self.groups)
        self.inner_step, self.outer_step = d["inner_step"], d["outer_step"]
        if self.auto_period is not None:
            self.auto_period.load_state_dict(d["period"])
            self.sync_every = self.auto_period.period
        self._last_end = None

    def _check_state(self, d) -> dict:
        """A one-line ``ValueError`` for anything in ``d`` this object cannot load; else the outer
        optimizer's state to load (that of a version-1 state converted)."""
        from ..reducers.resume import check_reducer_state

        fmt = d.get("format") if isinstance(d, dict) else None
        if fmt not in (STATE_FORMAT, STATE_FORMAT_V1):
            raise ValueError(f"not a DiLoCo state dict (format {fmt!r}, expected {STATE_FORMAT!r})")
        P, rank = self.comm.world_size, self.comm.rank
        if fmt == STATE_FORMAT:  # (only the first format has neither)
            for key, low in (("world_size", 1), ("rank", 0)):
                v = d.get(key)
                if isinstance(v, bool) or not isinstance(v, int) or v < low:
                    raise ValueError(f"DiLoCo state: {key} must be an integer >= {low}, got {v!r}")
        if "world_size" in d and d["world_size"] != P:
            raise ValueError(f"DiLoCo state saved at world size {d['world_size']!r} cannot be loaded at world size "
                             f"{P}: the pseudo-gradient residuals and the outer step are per world (resume at the same "
                             "size)")
        if "rank" in d and d["rank"] != rank:
            raise ValueError(f"DiLoCo state saved by rank {d['rank']!r} cannot be loaded on rank {rank}: the reducers' "
                             "residuals are per rank (load every rank's own state)")
        mine = "auto" if self.auto_period is not None else self.sync_every
        if d.get("sync_every") != mine or d.get("reducer") != self.reducer_name:
            raise ValueError(f"DiLoCo state of sync_every={d.get('sync_every')}, reducer={d.get('reducer')!r} "
                             f"cannot be loaded into sync_every={mine}, reducer={self.reducer_name!r}")
        period = self.auto_period.check_state(d.get("period")) if self.auto_period is not None else self.sync_every
        shared = d.get("shared")
        if (not isinstance(shared, list) or len(shared) != len(self.groups)
                or any(not isinstance(s, torch.Tensor) or s.shape != g.shared.shape or s.dtype != g.shared.dtype
                       for s, g in zip(shared, self.groups))):
            got = ([(tuple(s.shape), s.dtype) if isinstance(s, torch.Tensor) else type(s).__name__ for s in shared]
                   if isinstance(shared, list) else type(shared).__name__)
            raise ValueError("DiLoCo state: the shared parameters do not match this module's parameter groups "
                             f"({got} vs {[(tuple(g.shared.shape), g.shared.dtype) for g in self.groups]})")
        if not nonneg_int(d.get("inner_step"), "inner_step") < period:
            raise ValueError(f"DiLoCo state: inner_step {d['inner_step']} outside [0, {period})")
        nonneg_int(d.get("outer_step"), "outer_step")
        opt_state = d.get("outer_optimizer")
        if fmt == STATE_FORMAT_V1:
            opt_state = outer_state_from_v1(self, opt_state)
        check_optimizer_state(self.outer_optimizer, opt_state)
        reducers = d.get("reducers")
        if not isinstance(reducers, list) or len(reducers) != len(self.groups):
            n = len(reducers) if isinstance(reducers, list) else type(reducers).__name__
            raise ValueError(f"DiLoCo state: {n} reducer states for {len(self.groups)} parameter groups")
        for r, g in zip(reducers, self.groups):
            check_reducer_state(g.reducer, r)
        self.overlap.check_state(d.get("in_flight"), self.groups)
        return opt_state

    # the names SparseDDP uses for its own sparsync state (the trainer checkpoints either the same way)
    sparsync_state_dict = state_dict
    load_sparsync_state_dict = load_state_dict
