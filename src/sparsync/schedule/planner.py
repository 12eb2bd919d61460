"""Plan search for the overlap engine: which parameters travel together, and when the plan is final.

``merge="wfbp"|"single"|"buckets:<MB>"`` is final from the start (no model needed). For
``merge="mgwfbp"|"optimal"`` (MG-WFBP, Shi, Chu & Li, INFOCOM 2019, §4-5) the first ``profile_warmup + profile_steps``
steps run with the provisional ``single`` plan (nothing is sent during backward, so the measured
backward times are undisturbed); the :class:`Planner` records the gradient-ready order and times,
and at the end of the last profiled step - the same step on every rank - takes rank 0's profile,
fits the cost model on the live group (:meth:`CostModel.measure`) and computes the final plan,
checked identical on every rank (CRC of the groups). ``profile=`` and ``cost_model=`` skip both.
"""

from __future__ import annotations

import zlib

import numpy as np

from .costmodel import CostModel
from .merge import STRATEGIES, evaluate, make_plan, needs_model, parse_strategy
from .profiler import BackwardProfile, ProfileRecorder

__all__ = ["Planner"]


class Planner:
    def __init__(self, merge: str, sizes: list[int], *, profile_warmup=2, profile_steps=5, cost_model=None,
                 profile=None, cost_max_bytes=64 << 20):
        parse_strategy(merge)
        self.merge = merge
        self.sizes = list(sizes)            # bytes per parameter, registration order
        self.n = len(self.sizes)
        self.profile_warmup = int(profile_warmup)
        self.profile_steps = int(profile_steps)
        self.cost_max_bytes = int(cost_max_bytes)
        self.cost_model = _as_cost_model(cost_model)
        self.profile = _as_profile(profile, self.n)
        self.recorder = ProfileRecorder(self.n)
        self.order = list(reversed(range(self.n)))  # provisional: reverse registration order
        self.final = not needs_model(merge)
        if not self.final and self.profile is not None and self.cost_model is not None:
            self.order = list(self.profile.order)
            self.final = True

    def initial_plan(self) -> list[list[int]]:
        """Groups of parameter indices in communication order (``single`` while profiling)."""
        if not self.final:
            return self.plan("single", None)
        uses_profile = needs_model(self.merge)  # then order == profile.order (set in __init__)
        return self.plan(self.merge, self.profile.t_b if uses_profile else None)

    def plan(self, strategy, t_b) -> list[list[int]]:
        sizes = [self.sizes[i] for i in self.order]
        cm = self.cost_model
        ranges = make_plan(strategy, t_b, sizes, *((cm.a, cm.b) if cm is not None else (0.0, 0.0)))
        return [[self.order[k] for k in range(i, j)] for i, j in ranges]

    def observe(self, steps_done: int, start: float, order: list[int], ready: list[float]) -> bool:
        """Record one finished step's backward (``steps_done`` counts it). True when profiling is
        over and :meth:`switch` must run now (same step on every rank)."""
        if self.final:
            return False
        if steps_done > self.profile_warmup:
            self.recorder.add(start, order, ready)
        return steps_done >= self.profile_warmup + self.profile_steps

    def switch(self, comm, reducer_name, density, reducer_options) -> list[list[int]]:
        """End of profiling: same inputs on every rank -> the same final plan on every rank."""
        prof = self.profile or self.recorder.result().broadcast(comm)
        cm = self.cost_model or CostModel.measure(
            comm, reducer_name, density, reducer_options,
            max_bytes=min(self.cost_max_bytes, max(sum(self.sizes), 1 << 16)))
        self.profile, self.cost_model = prof, cm
        self.order = list(prof.order)
        groups = self.plan(self.merge, prof.t_b)
        comm.check_same(zlib.crc32(repr(groups).encode()), "merge plan (crc32)")
        self.final = True
        return groups

    def predictions(self, strategies=STRATEGIES, t_f: float = 0.0) -> dict:
        """Predicted timeline of every strategy under the current profile and cost model."""
        if self.profile is None or self.cost_model is None:
            return {}
        sizes = [self.sizes[i] for i in self.profile.order]
        cm = self.cost_model
        out = {}
        for s in strategies:
            ranges = make_plan(s, self.profile.t_b, sizes, cm.a, cm.b)
            out[s] = evaluate(ranges, self.profile.t_b, sizes, cm.a, cm.b, t_f)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"merge": self.merge, "final": self.final, "order": list(self.order),
                "profile_samples": self.recorder.state(),
                "profile": None if self.profile is None else self.profile.to_dict(),
                "cost_model": None if self.cost_model is None else self.cost_model.to_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.final = bool(d["final"])
        self.order = list(d["order"])
        self.recorder.load(d.get("profile_samples") or [])
        self.profile = None if d.get("profile") is None else BackwardProfile(**d["profile"])
        self.cost_model = None if d.get("cost_model") is None else CostModel.from_dict(d["cost_model"])


def _as_cost_model(cm):
    if cm is None or isinstance(cm, CostModel):
        return cm
    if isinstance(cm, dict):
        return CostModel.from_dict(cm) if "a" in cm else CostModel(**cm)
    a, b = cm
    return CostModel(float(a), float(b), None, "given")


def _as_profile(prof, n):
    if prof is None:
        return None
    if isinstance(prof, dict):
        prof = BackwardProfile(list(prof["order"]), list(prof["t_b"]), int(prof.get("steps", 0)))
    if sorted(prof.order) != list(range(n)) or len(prof.t_b) != n:
        raise ValueError(f"profile must give an order over all {n} trainable parameters and one time each")
    if not np.isfinite(np.asarray(prof.t_b, dtype=float)).all():
        raise ValueError("profile times must be finite")
    return prof
