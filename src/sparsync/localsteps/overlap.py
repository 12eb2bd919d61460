"""DiLoCo's outer synchronisation overlapped with the next inner steps.

::

    dl = ss.DiLoCo(model, comm, opt, sync_every=8, reducer="sparseloco", density=0.0156, value_bits=2,
                   overlap=1)

Without overlap every rank waits, at the end of each period, for the reduction of the pseudo-gradients
before it takes another inner step. With ``overlap=tau`` (1 <= tau <= H) the end of a period only
*starts* the exchange:

1. every rank forms its pseudo-gradient ``delta_r = shared - local_r``, keeps a copy ``a_r`` of its
   parameters (the anchor) and hands ``delta_r`` to the reducer, on a communicator of its own (a second
   process group over the same ranks: the caller's collectives, e.g. an evaluation's, never interleave
   with it). The reducer selects and encodes now and posts its one collective without waiting
   (``reducer.start``; only ``staged`` reducers - ``dense``, ``sparseloco`` - have one): the network
   moves it while the inner steps compute, and no Python thread competes with them for the interpreter;
2. the inner steps go on from ``local_r``;
3. ``tau`` inner steps later the rank waits for the result and applies the outer step exactly as without
   overlap (``shared' = outer(shared, mean_r delta_r)``, bitwise the same on every rank), then sets
   ``local_r <- shared' + (local_r - a_r)``: the progress it made since the anchor is kept whole.

Every inner step enters exactly one pseudo-gradient (the next period's starts at ``shared'`` and
includes the ``tau`` steps), so error feedback stays conserving; under plain averaging (outer SGD lr 1,
no momentum) the apply leaves the mean of the ranks' parameters unchanged. The exchange is hidden when
``tau`` inner steps take at least as long as it does; the price is a staleness of ``tau`` steps in the
shared parameters each rank builds on. This is the one-outer-step-delayed update of Streaming DiLoCo
(Douillard et al. 2025, arXiv 2501.18512, which mixes local and global parameters instead of keeping the
local progress) and of Kale et al. 2025 ("Eager updates for overlapped communication and computation in
DiLoCo", arXiv 2502.12996).

State: with an exchange in flight, :meth:`Overlap.state_dict` waits for its result (the values do not
depend on when it is read) and saves it with the anchors and the count of steps since it began, so a
checkpoint taken while an exchange is in flight resumes bitwise. An exchange still in flight when the
caller stops is not applied (:meth:`DiLoCo.flush` applies it).
"""

from __future__ import annotations

import time

import torch

__all__ = ["Overlap", "check_overlap"]


def check_overlap(overlap, sync_every, reducer: str) -> int:
    """``overlap`` as an int in [0, H] (0: no overlap) for a staged ``reducer``; a one-line ValueError
    otherwise (an unknown reducer name raises the registry's error)."""
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"overlap must be an integer >= 0 (inner steps the exchange may take), got {overlap!r}")
    if not overlap:
        return 0
    if sync_every == "auto":
        raise ValueError("overlap needs a fixed sync_every (the automatic period times the blocking exchange)")
    if overlap > sync_every:
        raise ValueError(f"overlap must be at most sync_every ({sync_every}): one exchange in flight at a time, "
                         f"got {overlap}")
    from ..reducers.registry import REDUCERS

    if not REDUCERS.lookup(reducer).staged:
        staged = ", ".join(sorted(name for name, cls in REDUCERS.load_all().items() if cls.staged))
        raise ValueError(f"overlap needs a reducer whose exchange is one collective posted without waiting "
                         f"({staged}), not {reducer!r}")
    return overlap


class _Exchange:
    """One exchange in flight: ``wait()`` runs ``finish`` (waits for the posted collectives) once; a
    loaded state's exchange is ``done`` with its result."""

    def __init__(self, finish):
        self.finish, self.result = finish, None

    @classmethod
    def done(cls, result: dict) -> "_Exchange":
        ex = cls(None)
        ex.result = result
        return ex

    def wait(self) -> dict:
        if self.finish is not None:
            finish, self.finish = self.finish, None
            self.result = finish()
        return self.result


class Overlap:
    """The in-flight exchange of a :class:`~.diloco.DiLoCo` with ``overlap=steps`` (module docstring)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.pending: _Exchange | None = None
        self.since = 0     # inner steps taken since the pending exchange began
        self.anchors: list[torch.Tensor] = []

    def launch(self, groups, finish) -> float:
        """Step 1 for every group; ``finish(started)`` waits for the reducers' futures posted here. Returns
        the seconds it took."""
        t0 = time.perf_counter()
        if not self.anchors:
            self.anchors = [torch.empty_like(g.shared) for g in groups]
        for g, a in zip(groups, self.anchors):
            g.pseudo_gradient()
            g.read_back(into=a)
        started = [g.reducer.start(g.pseudo) for g in groups]
        self.pending, self.since = _Exchange(lambda: finish(started)), 0
        return time.perf_counter() - t0

    def due(self) -> bool:
        """Count one inner step; True when the pending exchange is to be applied now."""
        if self.pending is None:
            return False
        self.since += 1
        return self.since >= self.steps

    def finish(self, groups, apply) -> tuple[dict, float]:
        """Step 3: wait for the exchange, ``apply()`` the outer step from the shared parameters, add each
        rank's progress since its anchor. Returns the exchange's stats and the seconds spent waiting."""
        t0 = time.perf_counter()
        stats = self.pending.wait()
        wait_s = time.perf_counter() - t0
        with torch.no_grad():
            for g, a in zip(groups, self.anchors):
                for p, v in zip(g.params, g.views(a)):
                    torch.sub(p.detach().reshape(-1), v, out=v)  # the anchor becomes the progress since
            apply()
            for g, a in zip(groups, self.anchors):
                for p, v in zip(g.params, g.views(a)):
                    p.detach().add_(v.view_as(p))
        self.pending, self.since = None, 0
        return stats, wait_s

    # ------------------------------------------------------------------ state
    def state_dict(self, groups) -> dict | None:
        """None without an exchange in flight; else its result (waited for), the anchors and the steps since."""
        if self.pending is None:
            return None
        stats = self.pending.wait()
        return {"since": self.since, "stats": dict(stats),
                "average": [g.average.detach().cpu().clone() for g in groups],
                "anchors": [a.detach().cpu().clone() for a in self.anchors]}

    def check_state(self, d, groups) -> None:
        """A one-line ValueError for a saved in-flight exchange this object cannot load."""
        if d is None:
            return
        if not self.steps:
            raise ValueError("DiLoCo state holds an exchange in flight, but this DiLoCo has overlap=0")
        since = d.get("since") if isinstance(d, dict) else None
        if isinstance(since, bool) or not isinstance(since, int) or not 0 <= since < self.steps:
            raise ValueError(f"DiLoCo state: the exchange in flight must hold since in [0, {self.steps}), "
                             f"got {since!r}")
        if not isinstance(d.get("stats"), dict):
            raise ValueError("DiLoCo state: the exchange in flight has no stats dict")
        for key in ("average", "anchors"):
            ts = d.get(key)
            if (not isinstance(ts, list) or len(ts) != len(groups)
                    or any(not isinstance(t, torch.Tensor) or t.shape != g.shared.shape or t.dtype != g.shared.dtype
                           for t, g in zip(ts, groups))):
                raise ValueError(f"DiLoCo state: the exchange in flight's {key} do not match this module's "
                                 "parameter groups")

    def load_state_dict(self, d, groups) -> None:
        """Restore :meth:`state_dict`'s output (checked by :meth:`check_state`)."""
        if d is None:
            self.pending, self.since = None, 0
            return
        with torch.no_grad():
            for g, t in zip(groups, d["average"]):
                g.average.copy_(t)
            self.anchors = [t.to(g.shared.device).clone() for g, t in zip(groups, d["anchors"])]
        self.pending, self.since = _Exchange.done(dict(d["stats"])), d["since"]
