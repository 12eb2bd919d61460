"""``auto``: picks the exchange from the measured link and gradient, and picks again when they change.

``make_reducer("auto", comm)`` (``SparseDDP(model, comm, reducer="auto")``, ``ddp_hook("auto")``,
``sparsync train --reducer auto``) holds one *active* candidate reducer - created by name through the
registry - and hands every call to it. Each merge group has its own instance, so each group decides
for itself. Candidates (option ``candidates``, a list or one string separated by ``/``, ``,`` or ``;``;
each spelled ``"dense"``, ``"dense:fp16"``,
``"micro:0.01"``, ``"micro:0.02:fp16"``, ``"hier:micro:0.01"``): by default dense fp32, dense with fp16
values (torch's ``fp16_compress_hook``), ``sparse`` (micro) at ``densities`` 1/2/5 % with fp32 and
fp16 values, and - when the ranks sit in several sites of several ranks (:func:`sparsync.site_layout`)
- ``hier`` with each of those sparse reducers between the sites.

What it decides from:

(a) **a probe** at the first call and again at a periodic decision or when a re-check of the link
    (one all-reduce per level, see below) moved: ``probe_repeats``
    timed all-reduces of two sizes per level (the whole group; with sites, inside a site and across
    sites) - 256 values for the latency, and a size that grows
    from 16 Ki values until the bytes dominate its time (:meth:`LinkModel._probe`) -, fitted to
    ``t = alpha * rounds + beta * bytes`` of the ring (``2(P-1)`` rounds, ``2(P-1)/P * size`` bytes):
    latency alpha and inverse bandwidth beta per level (Hockney's model, as in the documents' cost
    formulas); the maximum over ranks;
(b) **per-call times** of the active candidate: its wall time (``total_s``), its wire time
    (``comm_s``) and the time between calls (``gap``: the step's compute outside this group's
    reduce; before the first call, the compute since ``compute_start``, which SparseDDP sets to the
    start of backward). Where the link is declared (``link=``, no probe) a bandwidth-bound call
    refits the level's beta from its wire time; a probed link is only ever the probe's. The measured
    total minus the predicted wire becomes that reducer's CPU overhead per element (priors
    :data:`~sparsync.autotune.link.CPU_PRIOR_S` until measured, scaled by how much slower than
    their priors the sparse reducers measured so far ran) - on shared cores a sparse call's "wire"
    is mostly waiting for the other ranks, which is CPU, not link. A candidate's predicted time is
    ``alpha * rounds + beta * bytes`` from its registered ``predicted_cost`` (per level for ``hier``)
    plus its overhead - or, for a candidate that ran since the last link change (the probed bandwidth
    moved by 2x), the median of the time per call of its windows since then (the last 8), so that
    one window slowed by a busy core moves it little;
(c) **gradient statistics**: on a fixed sample of ``sample`` entries of the accumulated gradient
    (``grad + residual`` of the active candidate), the fraction ``kept(d)`` of its squared mass that
    the largest ``d`` share of entries hold, per density (one sort of the sample, vectorised), mean
    over ranks. Under error feedback the accumulated vector spreads, so while a dense candidate runs
    (no residual) the last value measured under a sparse one stands in, and before any, the kept
    mass of the vector two steps of error feedback would make of the sample
    (:func:`~sparsync.autotune.kept.kept_under_feedback`).

The objective is time per unit of progress: ``score = penalty(kept) * (gap + t_candidate)``, with
the **convergence cost of low density** ``penalty(kept) = 1 + c * (1 - kept) / kept`` - the expected
number of steps relative to the exact exchange. Error feedback makes a sparsified method converge at
SGD's rate with a slow-down governed by how much of the accumulated vector one step transmits (the
compression parameter ``delta`` of the contraction ``||x - C(x)||^2 <= (1 - delta) ||x||^2``; top-k
keeps ``delta = kept``): Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019 (a ``(1 - delta) / delta^2`` term);
Lin et al., "Deep Gradient Compression", ICLR 2018, for the practice. The first-order term
``(1 - delta) / delta`` is what we charge; ``c = penalty`` (:data:`PENALTY`) is calibrated from measured
steps to target of plain error-feedback MiCRO on the digits MLP (4 workers, Nesterov SGD: dense 36
steps, micro 1 / 2 / 5 % 49.5 / 48 / 40 at kept mass 0.185 / 0.255 / 0.406: c = 0.085 / 0.114 / 0.076).
Values in fp16 are charged nothing.

Re-decision: every ``check_every`` calls the ranks exchange their window's measurements and
statistics (one small all-gather of control data). When the measured time per call of the active
candidate differs from its prediction by more than ``deviation`` (``(measured + 5 ms) / (predicted +
5 ms)`` outside ``[1/deviation, deviation]``) the link is re-checked at once - one all-reduce per
level of the size the probe puts at ~10 ms (:data:`~sparsync.autotune.link.RECHECK_S`), timed once -
and where that time moved by more than 2x probed in full: a bandwidth moved by more than 2x is a
decision now, within ``check_every`` calls of the change. The first window after the start is
re-checked whatever its time: a start probe that a rank off its core made read a fast link as a slow
one shows there. Else the candidates are scored again when a second window in a row is
off the same way (one window slowed by a busy core is not a change of CPU time), and every
``decide_every`` calls (the measured time is the median over the candidate's windows). Between
checks an optional **watch** (``watch=3``; off by default: its all-gather at every call cost 16-80
ms per call on a shaped emulated link, more than it saves) reacts to an abrupt change: at every
call the ranks share the previous call's time (the maximum over ranks, one all-gather of one
number); when it is off the time that candidate measured at its last check by more than ``watch``
(the factor), the link is re-checked and, where that moved, probed; if its bandwidth moved by
more than 2x the check runs at once on that call alone - a link whose rate drops costs one slow
step, not ``check_every``; a call slowed by a busy core leaves the choice alone. The reason names
a link change when the probed bandwidth moved by more than 2x, else a
change of CPU time. **Every rank makes the same decision**: it decides from the
all-gathered values only (maximum over ranks of times, mean of the kept mass), with deterministic
tie-breaking (the candidates' order) and a hysteresis (``margin``: the active candidate stays unless
another scores ``margin`` lower, default 10 %).

The first ``warmup`` calls of a run (allocations, first connections, a machine warming up) and the
first call of each newly chosen candidate (its set-up) are not measurements; the first window after
the start decision is read once it holds ``check_every - 1`` measured calls.

Switching never loses gradient: the old candidate's residual is added to the first input of the new
one (:func:`_carry_residual`), so the conservation identity of :mod:`sparsync.reducers.base` holds
across a switch. ``stats["auto"]`` holds the active candidate and, on a call that decided, the
decision (``reason``, predicted ms and score per candidate, kept mass per density, chosen).
``state_dict`` holds the choice, the estimates, the window and the active candidate's state (bitwise
resume across a decision change). Options ``link={"flat": (alpha, beta), ...}`` (seconds, seconds
per byte) declare the link: no probe, ever; ``timings`` (attribute, a callable) replaces measured times in tests.
"""

from __future__ import annotations

import time

import torch

from ..autotune.candidates import Candidate, conserving, listed, parse_candidate
from ..autotune.decision import Decisions
from ..autotune.kept import PENALTY, KeptMass, penalty_factor
from ..autotune.link import LinkModel
from ..sites import site_layout
from .base import VALUE_DTYPES, Reducer
from .registry import REDUCERS, make_reducer, register

__all__ = ["AutoReducer", "Candidate", "parse_candidate", "penalty_factor", "PENALTY"]

_listed, _conserving = listed, conserving  # the names this module had before its parts moved


# ---------------------------------------------------------------------- the one residual hand-over
def _carry_residual(old: Reducer | None) -> torch.Tensor | None:
    """THE place a residual moves between candidates: what the outgoing candidate kept back (its
    public ``residual``, a copy). :meth:`AutoReducer._reduce` adds it to the next input of the new
    candidate, so the mass is transmitted or kept by the new one - never dropped."""
    if old is None:
        return None
    res = old.residual
    return None if res is None else res.detach().clone()


@register("auto")
class AutoReducer(Decisions, KeptMass, LinkModel, Reducer):
    """``make_reducer("auto", comm, density, candidates=None, sparse="micro", densities=(0.01, 0.02,
    0.05), values=("fp32", "fp16"), sites=None, decide_every=50, check_every=5, deviation=1.5,
    watch=0.0, margin=0.1, warmup=3, penalty=PENALTY, probe=True, probe_repeats=2, link=None, sample=65536,
    candidate_options=None)``; see the module docstring. ``density`` is unused unless a candidate
    spelling omits its own."""

    def __init__(self, comm, density: float = 0.01, candidates=None, sparse: str = "micro",
                 densities=(0.01, 0.02, 0.05), values=("fp32", "fp16"), sites=None, decide_every: int = 50,
                 check_every: int = 5, deviation: float = 1.5, watch: float = 0.0, margin: float = 0.1,
                 warmup: int = 3,
                 penalty: float = PENALTY,
                 probe: bool = True, probe_repeats: int = 2, link: dict | None = None, sample: int = 65536,
                 candidate_options: dict | None = None, value_dtype: str = "fp32", nonfinite: str = "error"):
        if value_dtype != "fp32":
            raise ValueError("auto chooses the value precision itself (values=...); do not pass value_dtype")
        super().__init__(comm, density=density, nonfinite=nonfinite)
        for k, v, lo in (("decide_every", decide_every, 1), ("check_every", check_every, 1), ("warmup", warmup, 1),
                         ("probe_repeats", probe_repeats, 1), ("sample", sample, 16)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"auto: {k} must be an integer >= {lo}, got {v!r}")
        if not (isinstance(deviation, (int, float)) and deviation > 1):
            raise ValueError(f"auto: deviation must be a factor > 1, got {deviation!r}")
        if isinstance(watch, bool) or not (isinstance(watch, (int, float)) and (watch == 0 or watch > 1)):
            raise ValueError(f"auto: watch must be 0 (off) or a factor > 1, got {watch!r}")
        if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
            raise ValueError(f"auto: margin must be in [0, 1), got {margin!r}")
        if not (isinstance(penalty, (int, float)) and penalty >= 0):
            raise ValueError(f"auto: penalty must be >= 0, got {penalty!r}")
        values, densities = listed(values), listed(densities)  # "fp32/fp16", "0.01/0.02" from the CLI
        for v in values:
            if v not in VALUE_DTYPES:
                raise ValueError(f"auto: values must be among {', '.join(VALUE_DTYPES)}, got {v!r}")
        try:
            self.densities = tuple(float(d) for d in densities)
        except (TypeError, ValueError):
            raise ValueError(f"auto: densities must be numbers in (0, 1], got {densities!r}") from None
        if not self.densities or any(not (0 < d <= 1) for d in self.densities):
            raise ValueError(f"auto: densities must be in (0, 1], got {densities!r}")
        self.layout = None if sites is None else site_layout(comm.world_size, sites)
        if self.layout is None:
            self.layout = site_layout(comm.world_size)
        multi = self.layout is not None and len(self.layout) > 1 and len(self.layout[0]) > 1
        if candidates is None:
            candidates = ["dense"] + [f"dense:{v}" for v in values if v != "fp32"]
            candidates += [f"{sparse}:{d:g}:{v}" for d in self.densities for v in values]
            if multi:
                candidates += [f"hier:{sparse}:{d:g}:{v}" for d in self.densities for v in values]
        else:
            candidates = listed(candidates)
        self.candidates = [parse_candidate(c, density) for c in candidates]
        if not self.candidates:
            raise ValueError("auto: no candidates")
        if any(c.reducer == "hier" for c in self.candidates) and not multi:
            raise ValueError("auto: a hier candidate needs several sites of several ranks (sites= or the "
                             "environment, see sparsync.site_layout)")
        self.candidate_options = dict(candidate_options or {})
        self.conserving = all(conserving(c) for c in self.candidates)
        # an instance *may* return an IndexedSum (when its active candidate does): SparseDDP then
        # writes only the non-zeros, as with that candidate alone; the class declares False (not always)
        self.indexed_output = any(REDUCERS.lookup(c.reducer).indexed_output for c in self.candidates)
        self.decide_every, self.check_every = decide_every, check_every
        self.deviation, self.margin, self.penalty = float(deviation), float(margin), float(penalty)
        self.watch = float(watch)
        self.warmup = warmup
        self.probe, self.probe_repeats, self.sample = bool(probe), probe_repeats, sample
        self.link: dict[str, list[float]] = {}
        self.probe_calls: dict[str, list] = {}  # per level the re-check's call: [values, seconds]
        self.declared = link is not None  # a declared link is never re-probed
        if not probe and link is None:
            raise ValueError("auto: probe=False needs link={'flat': (alpha_s, beta_s_per_byte)}")
        if link is not None:
            self.link = {k: [float(a), float(b)] for k, (a, b) in dict(link).items()}
            if "flat" not in self.link:
                raise ValueError("auto: link= needs at least a 'flat' entry (alpha s, beta s/byte)")
        self.cpu: dict[str, float] = {}      # measured CPU seconds per element, per reducer name
        self.measured: dict[str, list[float]] = {}  # window medians of each candidate since the last link change
        self.active: int | None = None       # index into candidates
        self._cand: Reducer | None = None
        self._carry: torch.Tensor | None = None
        self.window: list[list[float]] = []  # this rank's [wire_s, total_s, gap_s] per call since the last check
        self.kept: dict[float, float] = {}   # kept mass per density (mean over ranks) the decisions use
        self.kept_ef: dict[float, float] = {}  # the last one measured while a sparse candidate (residual) ran
        self.last_decision: dict | None = None
        self.decisions: list[dict] = []      # every decision (step, choice, reason, ...)
        self.since_decision = 0
        self.timings = None                  # tests: callable(reducer, event dict) -> event dict
        self._last_end: float | None = None
        self._sample_idx: torch.Tensor | None = None
        self._last_cost: dict = {}
        self._fresh = 0  # calls of the active candidate still to run before its times are measurements

    # ------------------------------------------------------------------ residual = active's + carried
    @property
    def residual(self) -> torch.Tensor | None:
        cand = self.__dict__.get("_cand")
        res = None if cand is None else cand.residual
        carry = self.__dict__.get("_carry")
        if carry is None:
            return res
        return carry.clone() if res is None else res + carry

    @residual.setter
    def residual(self, value) -> None:
        self.__dict__["_carry"] = value
        cand = self.__dict__.get("_cand")
        if cand is not None:
            cand.residual = None

    @property
    def choice(self) -> str | None:
        """The active candidate's spelling (None before the first call)."""
        return None if self.active is None else self.candidates[self.active].spec

    # ------------------------------------------------------------------ the call
    def _reduce(self, grad: torch.Tensor):
        t_start = time.perf_counter()
        gap = None if self._last_end is None else t_start - self._last_end
        if gap is None and self.compute_start is not None:  # the first call: the compute since it began
            gap = max(0.0, t_start - self.compute_start)
        decision = None
        if self.active is None:
            probe_s = 0.0
            if not self.link:
                cache = self.comm.__dict__.setdefault("_auto_link", {})  # one probe per communicator
                key = repr(self.layout)
                if key not in cache:
                    probe_s = self._probe(grad.numel())
                    cache[key] = ({k: list(v) for k, v in self.link.items()},
                                  {k: list(v) for k, v in self.probe_calls.items()})
                link, calls = cache[key]
                self.link = {k: list(v) for k, v in link.items()}
                self.probe_calls = {k: list(v) for k, v in calls.items()}
            # the step's compute so far (when the caller said when it began: compute_start), max over ranks
            (hint,), kept = self._gather([0.0 if gap is None else gap], self._kept_local(grad))
            decision = self._decide(grad.numel(), hint, kept, "start")
            decision["probe_s"] = probe_s
        elif self.step % self.check_every == 0 and len(self.window) >= self._window_needed():
            decision = self._check(grad)
        elif self.watch and self.window and self.candidates[self.active].spec in self.measured:
            decision = self._watch(grad)
        x = grad if self._carry is None else grad + self._carry  # (a sum of its own: auto's to give)
        cand = self._cand
        # an IndexedSum where the candidate makes one (base.reduce densifies it for a caller that did
        # not ask for one); the input passed on as donated when the caller donated it, or it is auto's.
        # The carry is dropped only once the candidate took it (a call that raises absorbed nothing).
        try:
            out = cand.reduce(x, indexed=True, donate=self.donated or x is not grad)
        except FloatingPointError as e:
            if self._carry is not None and bool(torch.isfinite(grad).all()):
                raise FloatingPointError(f"auto.reduce: the gradient is finite but its sum with the residual "
                                         f"carried from an earlier candidate is not (the residual overflowed; "
                                         f"step {self.step})") from e
            raise
        self._carry = None
        st = cand.stats
        ev = {"wire_s": float(st.get("comm_s", 0.0)), "total_s": float(st.get("total_s", 0.0))}
        self._last_cost = {k: st.get(k, 0) for k in ("rounds", "bytes_received", "intra_rounds",
                                                     "intra_bytes_received", "inter_rounds", "inter_bytes_received")}
        if self.timings is not None:
            ev = self.timings(self, {"event": "call", "candidate": self.choice, **ev})
        if self._fresh:  # a candidate's first call pays its set-up (checks, buffers), the run's first calls
            self._fresh -= 1  # its warm-up (allocations, first connections): not measurements
        else:
            self.window.append([ev["wire_s"], ev["total_s"], -1.0 if gap is None else gap])
        self.since_decision += 1
        keep = ("select_s", "comm_s", "selected", "intra_bytes", "inter_bytes", "intra_bytes_received",
                "inter_bytes_received", "intra_rounds", "inter_rounds", "sites")
        self.stats.update({k: st[k] for k in keep if k in st})
        self.stats["auto"] = {"choice": self.choice, **({"decision": decision} if decision else {})}
        self._last_end = time.perf_counter()
        return out

    def _window_needed(self) -> int:
        """Measured calls a window needs before a check reads it: 2; the first window after the start
        decision ``check_every - 1`` (it decides on measured times, and one busy core in a window of
        two made auto leave the right candidate for a run)."""
        return max(2, self.check_every - 1) if len(self.decisions) == 1 else 2

    def _switch(self, i: int) -> None:
        c = self.candidates[i]
        carried = _carry_residual(self._cand)
        if carried is not None:
            self._carry = carried if self._carry is None else self._carry + carried
        opts = dict(self.candidate_options.get(c.reducer, {}))
        if c.reducer == "hier":
            opts.update(outer=c.outer, sites=self.layout, **self.candidate_options.get(c.outer, {}))
        if c.value_dtype != "fp32":
            opts["value_dtype"] = c.value_dtype
        self._cand = make_reducer(c.reducer, self.comm, c.density, nonfinite=self.nonfinite, **opts)
        self._cand.step = self.step
        self.active = i
        self._fresh = 1 if self.decisions else self.warmup

    # ------------------------------------------------------------------ state
    def _extra_state(self) -> dict:
        """The choice, the carried residual, the active candidate's state and the kept-mass estimates
        (what a bitwise resume restores), and apart from them ``timings``: the measured link, CPU
        and call times and the decisions taken on them - wall-clock readings that a resumed run
        continues from but that no two runs share, so they are not part of a bitwise comparison."""
        timings = {"link": {k: list(v) for k, v in self.link.items()},
                   "probe_calls": {k: list(v) for k, v in self.probe_calls.items()}, "cpu": dict(self.cpu),
                   "measured": {k: list(v) for k, v in self.measured.items()},
                   "window": [list(r) for r in self.window], "last_cost": dict(self._last_cost),
                   "decisions": list(self.decisions), "last_decision": self.last_decision}
        return {"candidates": [c.spec for c in self.candidates], "active": self.active,
                "kept": dict(self.kept), "kept_ef": dict(self.kept_ef),
                "since_decision": self.since_decision, "fresh": self._fresh,
                "carry": None if self._carry is None else self._carry.detach().cpu().clone(),
                "candidate": None if self._cand is None else self._cand.state_dict(), "timings": timings}

    def _check_extra_state(self, d: dict, numel) -> None:
        specs = [c.spec for c in self.candidates]
        if d.get("candidates") is not None and d["candidates"] != specs:
            raise ValueError(f"auto state was saved with candidates {d['candidates']}, this reducer has {specs}")
        a = d.get("active")
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < len(specs)):
            raise ValueError(f"auto state: active must be a candidate index in [0, {len(specs)}), got {a!r}")
        carry = d.get("carry")
        if carry is not None and not (isinstance(carry, torch.Tensor) and carry.dim() == 1
                                      and carry.dtype.is_floating_point and carry.numel() == numel
                                      and bool(torch.isfinite(carry).all())):
            shape = tuple(carry.shape) if isinstance(carry, torch.Tensor) else type(carry).__name__
            raise ValueError(f"auto state: the carried residual must be a finite 1-D float tensor of {numel} "
                             f"entries, got {shape}")
        if d.get("candidate") is not None and a is None:
            raise ValueError("auto state: a candidate's state without an active candidate")
        for key in ("since_decision", "fresh"):
            v = d.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"auto state: {key} must be an integer >= 0, got {v!r}")

    def _load_extra_state(self, d: dict) -> None:
        d = {**d, **(d.get("timings") or {})}  # (a state written before the timings had a key of their own)
        self.link = {k: list(v) for k, v in (d.get("link") or {}).items()}
        self.probe_calls = {k: list(v) for k, v in (d.get("probe_calls") or {}).items()}
        self.cpu = dict(d.get("cpu") or {})
        self.measured = {k: (list(v) if isinstance(v, (list, tuple)) else [float(v)])
                         for k, v in (d.get("measured") or {}).items()}
        self.window = [list(r) for r in d.get("window") or []]
        self.kept = dict(d.get("kept") or {})
        self.kept_ef = dict(d.get("kept_ef") or {})
        self.since_decision = int(d.get("since_decision", 0))
        self.decisions = list(d.get("decisions") or [])
        self.last_decision = d.get("last_decision")
        carry = d.get("carry")
        self._carry = None if carry is None else carry.to(self.comm.device).clone()
        self.active, self._cand = None, None
        if d.get("active") is not None:
            keep = self._carry
            self._switch(int(d["active"]))
            self._carry = keep
            if d.get("candidate") is not None:
                self._cand.load_state_dict(d["candidate"])
        self._fresh = int(d.get("fresh", 0))
        self._last_cost = dict(d.get("last_cost") or {})
        self._last_end = None

    @classmethod
    def predicted_cost(cls, P, n, k=None, value_bytes=4, index_bytes=4, **_):
        return None  # depends on the choice made at run time
