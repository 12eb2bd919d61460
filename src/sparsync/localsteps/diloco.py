"""DiLoCo: local steps of an inner optimizer, then an outer Nesterov step on the reduced pseudo-gradient.

::

    dl = ss.DiLoCo(model, comm, torch.optim.AdamW(model.parameters()), sync_every=16)   # dense
    dl = ss.DiLoCo(model, comm, opt, sync_every=16, reducer="micro", density=0.02)      # sparse
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
3. divides the sum by the world size P and takes one step of ``torch.optim.SGD(lr=outer_lr,
   momentum=outer_momentum, nesterov=outer_momentum > 0)`` on the shared parameters with that
   average as their gradient (DiLoCo's outer optimizer; paper defaults lr 0.7, momentum 0.9);
4. copies the new shared parameters into the module's parameters.

The reducer's sum is bitwise identical on every rank (the reducer contract), so the shared
parameters, the outer momentum and hence every rank's parameters after an outer step are bitwise
identical. With H = 1, ``outer_lr=1``, ``outer_momentum=0``, an inner SGD without momentum and the
dense reducer this is synchronous data-parallel SGD (``delta_r = lr g_r``, up to float rounding of
``shared - (shared - lr g_r)``). With ``outer_lr=1``, ``outer_momentum=0`` and the dense reducer it is
local SGD / model averaging every H steps (Lin et al. 2020, "Don't use large mini-batches, use local
SGD"; torch's ``PeriodicModelAverager``).

State (:meth:`state_dict` / :meth:`load_state_dict`; tensors and plain data, no process group):
the shared parameters, the outer optimizer (its momentum buffer), the inner step counter within the
current cycle, the outer step count, with ``sync_every="auto"`` the period and its measurements,
and every reducer's state (residual included). To resume
bitwise - also from a checkpoint taken in the middle of an outer cycle - save, on every rank, the
module's parameters (``model.state_dict()``: the local parameters of this rank), the inner
optimizer's ``state_dict()`` and this object's ``state_dict()``; load all three before the next
step. Module buffers (e.g. BatchNorm statistics) are broadcast from rank 0 at construction and
stay local afterwards.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .period import MAX_PERIOD, AutoPeriod, default_period_cost

__all__ = ["DiLoCo", "STATE_FORMAT", "default_reducer_options"]

STATE_FORMAT = "sparsync-diloco/1"


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
        outer_lr, outer_momentum: the outer Nesterov SGD (``outer_momentum=0``: plain SGD).
        init_sync: broadcast rank 0's parameters and buffers at construction (default True), so
            every rank starts from the same shared parameters.
        **reducer_options: passed to the reducer (``value_dtype="fp32"`` turns half-precision values off).

    After each call of :meth:`step`, ``last_stats`` holds ``synced`` (whether this call ran the
    outer synchronisation), ``outer_step``, ``sync_every`` (the period in force), and for the
    synchronisation the reducer's ``select_s``,
    ``comm_s``, ``bytes_sent``, ``bytes_received``, ``selected``, ``density`` plus ``inner_s`` and
    ``outer_s`` (seconds of the inner step and of the whole outer synchronisation); calls without
    synchronisation report zero bytes and zero density.
    """

    def __init__(self, module: nn.Module, comm, inner_optimizer, sync_every: int, reducer: str = "dense",
                 density: float = 0.01, outer_lr: float = 0.7, outer_momentum: float = 0.9, *,
                 init_sync: bool = True, period_cost: float | None = None, max_period: int = MAX_PERIOD,
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
        if not (float(outer_lr) > 0):
            raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
        if not (0 <= float(outer_momentum) < 1):
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        reducer_options = default_reducer_options(reducer, reducer_options)
        self.comm = comm = _as_comm(comm, module)
        self.module = module
        self.inner_optimizer = inner_optimizer
        cost = default_period_cost(inner_optimizer) if period_cost is None else period_cost
        self.auto_period = AutoPeriod(self.comm, cost, max_period) if auto else None  # (checks its options)
        self.sync_every = self.auto_period.period if auto else int(sync_every)
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.reducer_name = reducer
        named = start_in_sync(module, comm, "DiLoCo", init_sync)
        by_kind: dict = {}
        for _, p in named:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        self.groups = [_Group(ps, make_reducer(reducer, comm, density=density, **reducer_options))
                       for ps in by_kind.values()]
        mom = self.outer_momentum
        self.outer_optimizer = torch.optim.SGD([g.shared for g in self.groups], lr=self.outer_lr,
                                               momentum=mom, nesterov=mom > 0)
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
        if self.inner_step < self.sync_every:
            self.last_stats = {"synced": False, "outer_step": self.outer_step, "inner_s": t1 - t0, "outer_s": 0.0,
                               "select_s": 0.0, "comm_s": 0.0, "bytes_sent": 0, "bytes_received": 0,
                               "selected": 0, "numel": self.numel, "density": 0.0, "sync_every": self.sync_every}
        else:
            period = self.sync_every
            self.sync()
            if self.auto_period is not None:
                self.sync_every = self.auto_period.choose(self.last_stats["outer_s"], self.outer_step)
            self.last_stats.update(inner_s=t1 - t0, sync_every=period)
        self._last_end = time.perf_counter()
        return loss

    @property
    def numel(self) -> int:
        return sum(g.shared.numel() for g in self.groups)

    @torch.no_grad()
    def sync(self) -> None:
        """The outer synchronisation now (``step`` calls it every ``sync_every`` calls): reduce the
        pseudo-gradient, average, outer Nesterov step on the shared parameters, write them back."""
        t0 = time.perf_counter()
        P = self.comm.world_size
        stats = {"select_s": 0.0, "comm_s": 0.0, "bytes_sent": 0, "bytes_received": 0, "selected": 0}
        for g in self.groups:
            out = g.reducer.reduce(g.pseudo_gradient())
            g.shared.grad = torch.div(out, P, out=g.average)
            for k in stats:
                stats[k] += g.reducer.stats.get(k, 0) or 0
        self.outer_optimizer.step()
        for g in self.groups:
            g.shared.grad = None
            g.write_back()
        self.inner_step = 0
        self.outer_step += 1
        self.last_stats = {"synced": True, "outer_step": self.outer_step, "outer_s": time.perf_counter() - t0,
                           "numel": self.numel, "density": stats["selected"] / max(1, self.numel), **stats}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Shared parameters, outer optimizer, cycle position and reducers' states (no process group)."""
        return {"format": STATE_FORMAT, "reducer": self.reducer_name,
                "sync_every": "auto" if self.auto_period is not None else self.sync_every,
                "period": None if self.auto_period is None else self.auto_period.state_dict(),
                "inner_step": self.inner_step, "outer_step": self.outer_step,
                "shared": [g.shared.detach().cpu().clone() for g in self.groups],
                "outer_optimizer": self.outer_optimizer.state_dict(),
                "reducers": [g.reducer.state_dict() for g in self.groups]}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict`'s output; a ``ValueError`` names any mismatch (nothing is changed then)."""
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
            raise ValueError(f"not a DiLoCo state dict (format {d.get('format') if isinstance(d, dict) else None!r}, "
                             f"expected {STATE_FORMAT!r})")
        mine = "auto" if self.auto_period is not None else self.sync_every
        if d["sync_every"] != mine or d["reducer"] != self.reducer_name:
            raise ValueError(f"DiLoCo state of sync_every={d['sync_every']}, reducer={d['reducer']!r} cannot be "
                             f"loaded into sync_every={mine}, reducer={self.reducer_name!r}")
        period = int(d["period"]["period"]) if self.auto_period is not None else self.sync_every
        shared = d["shared"]
        if len(shared) != len(self.groups) or any(s.shape != g.shared.shape for s, g in zip(shared, self.groups)):
            raise ValueError("DiLoCo state: the shared parameters do not match this module's parameter groups "
                             f"({[tuple(s.shape) for s in shared]} vs {[tuple(g.shared.shape) for g in self.groups]})")
        if not 0 <= int(d["inner_step"]) < period:
            raise ValueError(f"DiLoCo state: inner_step {d['inner_step']} outside [0, {period})")
        with torch.no_grad():
            for s, g in zip(shared, self.groups):
                g.shared.copy_(s)
        self.outer_optimizer.load_state_dict(d["outer_optimizer"])
        for r, g in zip(d["reducers"], self.groups):
            g.reducer.load_state_dict(r)
        self.inner_step, self.outer_step = int(d["inner_step"]), int(d["outer_step"])
        if self.auto_period is not None:
            self.auto_period.load_state_dict(d["period"])
            self.sync_every = self.auto_period.period
        self._last_end = None

    # the names SparseDDP uses for its own sparsync state (the trainer checkpoints either the same way)
    sparsync_state_dict = state_dict
    load_sparsync_state_dict = load_state_dict
