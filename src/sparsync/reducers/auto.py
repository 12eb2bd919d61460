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

(a) **a probe** at the first call and again at every re-decision: ``probe_repeats`` timed
    all-reduces of two sizes per level (the whole group; with sites, inside a site and across sites),
    fitted to ``t = alpha * rounds + beta * bytes`` of the ring (``2(P-1)`` rounds, ``2(P-1)/P * size``
    bytes): latency alpha and inverse bandwidth beta per level (Hockney's model, as in the documents'
    cost formulas); the maximum over ranks;
(b) **per-call times** of the active candidate: its wall time (``total_s``), its wire time
    (``comm_s``) and the time between calls (``gap``: the step's compute outside this group's
    reduce). A bandwidth-bound call (dense) refits the level's beta from its wire time; the measured
    total minus the predicted wire becomes that reducer's CPU overhead per element (priors
    :data:`CPU_PRIOR_S` until measured) - on shared cores a sparse call's "wire" is mostly waiting
    for the other ranks, which is CPU, not link. A candidate's predicted time is ``alpha * rounds +
    beta * bytes`` from its registered ``predicted_cost`` (per level for ``hier``) plus its overhead -
    or, for a candidate that ran since the last link change (the probed bandwidth moved by 2x), the time
    per call it measured then;
(c) **gradient statistics**: on a fixed sample of ``sample`` entries of the accumulated gradient
    (``grad + residual`` of the active candidate), the fraction ``kept(d)`` of its squared mass that
    the largest ``d`` share of entries hold, per density (one sort of the sample, vectorised), mean
    over ranks. Under error feedback the accumulated vector spreads, so while a dense candidate runs
    (no residual) the last value measured under a sparse one stands in.

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
statistics (one small all-gather of control data); every ``decide_every`` calls, or at once when the
measured time per call of the active candidate differs from its prediction by more than ``deviation``
(``(measured + 5 ms) / (predicted + 5 ms)`` outside ``[1/deviation, deviation]``), the link is probed
again and the candidates are scored again; the reason names a link change when the probed bandwidth
moved by more than 2x, else a change of CPU time. **Every rank makes the same decision**: it decides from the
all-gathered values only (maximum over ranks of times, mean of the kept mass), with deterministic
tie-breaking (the candidates' order) and a hysteresis (``margin``: the active candidate stays unless
another scores ``margin`` lower).

Switching never loses gradient: the old candidate's residual is added to the first input of the new
one (:func:`_carry_residual`), so the conservation identity of :mod:`sparsync.reducers.base` holds
across a switch. ``stats["auto"]`` holds the active candidate and, on a call that decided, the
decision (``reason``, predicted ms and score per candidate, kept mass per density, chosen).
``state_dict`` holds the choice, the estimates, the window and the active candidate's state (bitwise
resume across a decision change). Options ``link={"flat": (alpha, beta), ...}`` (seconds, seconds
per byte) declare the link: no probe, ever; ``timings`` (attribute, a callable) replaces measured times in tests.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ..sites import site_layout
from .base import VALUE_DTYPES, Reducer
from .registry import REDUCERS, make_reducer, register

__all__ = ["AutoReducer", "Candidate", "parse_candidate", "penalty_factor"]

#: convergence cost coefficient c in ``1 + c (1 - kept) / kept``, calibrated on the
#: digits MLP (module docstring)
PENALTY = 0.09
#: CPU seconds per gradient element of a reducer until it has been measured (select, error feedback,
#: copies; a 2-core machine with 4 ranks); a measured value replaces them
CPU_PRIOR_S = {"dense": 1e-9, "micro": 5e-9, "hier": 6e-9}
CPU_PRIOR_OTHER = 8e-9
_EPS_S = 5e-3  # slack in the deviation test: tiny wires do not trigger re-decisions on noise
_LEVELS = ("flat", "intra", "inter")


def penalty_factor(kept: float, c: float = PENALTY) -> float:
    """Expected steps relative to an exact exchange when one step transmits the share ``kept`` of the
    accumulated gradient's squared mass: ``1 + c (1 - kept) / kept`` (module docstring)."""
    kept = min(1.0, max(1e-6, float(kept)))
    return 1.0 + c * (1.0 - kept) / kept


class Candidate:
    """One configuration auto can run: ``reducer`` at ``density`` with ``value_dtype`` values;
    ``outer`` for ``hier`` (the reducer between sites)."""

    __slots__ = ("reducer", "density", "value_dtype", "outer")

    def __init__(self, reducer: str, density: float = 1.0, value_dtype: str = "fp32", outer: str | None = None):
        self.reducer, self.density, self.value_dtype, self.outer = reducer, float(density), value_dtype, outer

    @property
    def sparse(self) -> bool:
        return self.reducer != "dense"

    @property
    def spec(self) -> str:
        """The spelling :func:`parse_candidate` reads (also the label in stats and reports)."""
        parts = [self.reducer] + ([self.outer] if self.outer else [])
        if self.sparse:
            parts.append(f"{self.density:g}")
        if self.value_dtype != "fp32":
            parts.append(self.value_dtype)
        return ":".join(parts)

    def __repr__(self) -> str:
        return f"Candidate({self.spec})"


def parse_candidate(spec: str, density: float = 0.01) -> Candidate:
    """``"dense"``, ``"dense:fp16"``, ``"micro:0.01"``, ``"micro:0.02:fp16"``, ``"hier:micro:0.01"``;
    ValueError (one line) for anything else."""
    parts = [p.strip() for p in str(spec).split(":") if p.strip()]
    if not parts:
        raise ValueError(f"auto: empty candidate {spec!r}")
    name, rest, outer = parts[0], parts[1:], None
    if name in ("auto",):
        raise ValueError("auto: a candidate cannot be 'auto' itself")
    known = REDUCERS.load_all()
    if name not in known:
        raise ValueError(f"auto: candidate {spec!r}: unknown reducer {name!r}; valid: {', '.join(sorted(known))}")
    if name == "hier":
        if not rest or rest[0] in VALUE_DTYPES or _is_number(rest[0]):
            raise ValueError(f"auto: candidate {spec!r}: hier needs its outer reducer, e.g. 'hier:micro:0.01'")
        outer, rest = rest[0], rest[1:]
        if outer not in REDUCERS.load_all() or outer in ("hier", "auto"):
            raise ValueError(f"auto: candidate {spec!r}: {outer!r} cannot be hier's outer reducer")
    d, vd = (1.0 if name == "dense" else density), "fp32"
    for p in rest:
        if p in VALUE_DTYPES:
            vd = p
        elif _is_number(p) and 0 < float(p) <= 1:
            d = float(p)
        else:
            raise ValueError(f"auto: candidate {spec!r}: {p!r} is neither a density in (0, 1] nor one of "
                             f"{', '.join(VALUE_DTYPES)}")
    cls = REDUCERS.lookup(outer or name)
    if VALUE_DTYPES[vd] is not None and not cls.supports_value_dtype:
        raise ValueError(f"auto: candidate {spec!r}: reducer {outer or name!r} cannot send {vd} values")
    return Candidate(name, d, vd, outer)


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


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
class AutoReducer(Reducer):
    """``make_reducer("auto", comm, density, candidates=None, sparse="micro", densities=(0.01, 0.02,
    0.05), values=("fp32", "fp16"), sites=None, decide_every=50, check_every=5, deviation=1.5,
    margin=0.05, penalty=PENALTY, probe=True, probe_repeats=2, link=None, sample=65536,
    candidate_options=None)``; see the module docstring. ``density`` is unused unless a candidate
    spelling omits its own."""

    def __init__(self, comm, density: float = 0.01, candidates=None, sparse: str = "micro",
                 densities=(0.01, 0.02, 0.05), values=("fp32", "fp16"), sites=None, decide_every: int = 50,
                 check_every: int = 5, deviation: float = 1.5, margin: float = 0.05, penalty: float = PENALTY,
                 probe: bool = True, probe_repeats: int = 2, link: dict | None = None, sample: int = 65536,
                 candidate_options: dict | None = None, value_dtype: str = "fp32", nonfinite: str = "error"):
        if value_dtype != "fp32":
            raise ValueError("auto chooses the value precision itself (values=...); do not pass value_dtype")
        super().__init__(comm, density=density, nonfinite=nonfinite)
        for k, v, lo in (("decide_every", decide_every, 1), ("check_every", check_every, 1),
                         ("probe_repeats", probe_repeats, 1), ("sample", sample, 16)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"auto: {k} must be an integer >= {lo}, got {v!r}")
        if not (isinstance(deviation, (int, float)) and deviation > 1):
            raise ValueError(f"auto: deviation must be a factor > 1, got {deviation!r}")
        if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
            raise ValueError(f"auto: margin must be in [0, 1), got {margin!r}")
        if not (isinstance(penalty, (int, float)) and penalty >= 0):
            raise ValueError(f"auto: penalty must be >= 0, got {penalty!r}")
        values, densities = _listed(values), _listed(densities)  # "fp32/fp16", "0.01/0.02" from the CLI
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
            candidates = _listed(candidates)
        self.candidates = [parse_candidate(c, density) for c in candidates]
        if not self.candidates:
            raise ValueError("auto: no candidates")
        if any(c.reducer == "hier" for c in self.candidates) and not multi:
            raise ValueError("auto: a hier candidate needs several sites of several ranks (sites= or the "
                             "environment, see sparsync.site_layout)")
        self.candidate_options = dict(candidate_options or {})
        self.conserving = all(_conserving(c) for c in self.candidates)
        self.decide_every, self.check_every = decide_every, check_every
        self.deviation, self.margin, self.penalty = float(deviation), float(margin), float(penalty)
        self.probe, self.probe_repeats, self.sample = bool(probe), probe_repeats, sample
        self.link: dict[str, list[float]] = {}
        self.declared = link is not None  # a declared link is never re-probed
        if not probe and link is None:
            raise ValueError("auto: probe=False needs link={'flat': (alpha_s, beta_s_per_byte)}")
        if link is not None:
            self.link = {k: [float(a), float(b)] for k, (a, b) in dict(link).items()}
            if "flat" not in self.link:
                raise ValueError("auto: link= needs at least a 'flat' entry (alpha s, beta s/byte)")
        self.cpu: dict[str, float] = {}      # measured CPU seconds per element, per reducer name
        self.measured: dict[str, float] = {}  # time per call of each candidate that ran since the last link change
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
        self._fresh = False  # the active candidate has not run yet

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
        decision = None
        if self.active is None:
            probe_s = 0.0
            if not self.link:
                cache = self.comm.__dict__.setdefault("_auto_link", {})  # one probe per communicator
                key = repr(self.layout)
                if key not in cache:
                    probe_s = self._probe(grad.numel())
                    cache[key] = {k: list(v) for k, v in self.link.items()}
                self.link = {k: list(v) for k, v in cache[key].items()}
            kept = self._gather([], self._kept_local(grad))[1]
            decision = self._decide(grad.numel(), 0.0, kept, "start")
            decision["probe_s"] = probe_s
        elif self.step % self.check_every == 0 and len(self.window) >= 2:
            decision = self._check(grad)
        x = grad if self._carry is None else grad + self._carry
        self._carry = None
        cand = self._cand
        out = cand.reduce(x)
        st = cand.stats
        ev = {"wire_s": float(st.get("comm_s", 0.0)), "total_s": float(st.get("total_s", 0.0))}
        self._last_cost = {k: st.get(k, 0) for k in ("rounds", "bytes_received", "intra_rounds",
                                                     "intra_bytes_received", "inter_rounds", "inter_bytes_received")}
        if self.timings is not None:
            ev = self.timings(self, {"event": "call", "candidate": self.choice, **ev})
        if self._fresh:  # a candidate's first call pays its set-up (checks, buffers): not a measurement
            self._fresh = False
        else:
            self.window.append([ev["wire_s"], ev["total_s"], -1.0 if gap is None else gap])
        self.since_decision += 1
        keep = ("select_s", "comm_s", "selected", "intra_bytes", "inter_bytes", "intra_bytes_received",
                "inter_bytes_received", "intra_rounds", "inter_rounds", "sites")
        self.stats.update({k: st[k] for k in keep if k in st})
        self.stats["auto"] = {"choice": self.choice, **({"decision": decision} if decision else {})}
        self._last_end = time.perf_counter()
        return out

    # ------------------------------------------------------------------ (a) probe
    def _probe(self, n: int) -> float:
        """Fit alpha, beta per level from timed ring all-reduces of two sizes (maximum over ranks)."""
        t0 = time.perf_counter()
        P = self.comm.world_size
        levels = [("flat", self.comm)]
        if self.layout is not None and len(self.layout) > 1 and len(self.layout[0]) > 1:
            s = len(self.layout[0])
            levels.append(("intra", self.comm.split(self.layout)))
            levels.append(("inter", self.comm.split([[site[j] for site in self.layout] for j in range(s)])))
        small, large = 256, max(4096, min(n, 1 << 18))
        mine = []
        for level, c in levels:
            for size in (small, large):
                buf = torch.ones(size, device=self.comm.device)
                best = math.inf
                for _ in range(self.probe_repeats):
                    self.comm.barrier()
                    a = time.perf_counter()
                    with c.unrecorded():
                        c.allreduce(buf, out=buf)
                    best = min(best, time.perf_counter() - a)
                if self.timings is not None:
                    ev = {"event": "probe", "level": level, "numel": size, "time_s": best}
                    best = self.timings(self, ev)["time_s"]
                mine.append(best)
        worst = self._gather(mine, [])[0]
        for i, (level, c) in enumerate(levels):
            p = c.world_size
            t_s, t_l = worst[2 * i], worst[2 * i + 1]
            rounds = max(1, 2 * (p - 1))
            b_s, b_l = (2 * (p - 1) * 4 * small / p, 2 * (p - 1) * 4 * large / p) if p > 1 else (0, 1)
            # on shared cores the small call can come out as slow as the large one: the large call's
            # own time per byte (half of it) bounds beta from below
            beta = max(1e-12, (t_l - t_s) / max(1.0, b_l - b_s), 0.5 * t_l / max(1.0, b_l))
            alpha = max(1e-7, (t_s - beta * b_s) / rounds)
            self.link[level] = [alpha, beta]
        if P == 1:
            self.link["flat"] = [0.0, 0.0]
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ (c) gradient statistics
    def _kept_local(self, grad: torch.Tensor) -> list[float]:
        """This rank's kept mass per density on a fixed sample of ``grad + residual``."""
        n = grad.numel()
        if self._sample_idx is None or self._sample_idx.numel() and int(self._sample_idx[-1]) >= n:
            g = torch.Generator().manual_seed(12345)  # the same positions on every rank and every call
            self._sample_idx = (torch.randint(0, n, (self.sample,), generator=g).unique() if self.sample < n
                                else torch.arange(n))
        idx = self._sample_idx.to(grad.device)
        x = grad.index_select(0, idx).double()
        res = self.residual
        if res is not None:
            x = x + res.index_select(0, idx).double()
        sq = (x * x).sort(descending=True).values
        total = float(sq.sum())
        if not total > 0 or not math.isfinite(total):
            return [1.0 for _ in self.densities]
        cs = sq.cumsum(0)
        m = sq.numel()
        return [float(cs[min(m, max(1, math.ceil(d * m))) - 1]) / total for d in self.densities]

    # ------------------------------------------------------------------ (b) measurements
    def _gather(self, maxed: list[float], meaned: list[float]) -> tuple[list[float], list[float]]:
        """(maximum over ranks of ``maxed``, mean over ranks of ``meaned``), the same on every rank:
        one all-gather of control data, combined in rank order."""
        mine = torch.tensor(list(maxed) + list(meaned), dtype=torch.float64, device=self.comm.device)
        if self.comm.world_size == 1 or mine.numel() == 0:
            return list(maxed), list(meaned)
        rows = torch.stack([t.reshape(-1).cpu() for t in self.comm.allgather_control(mine)])
        k = len(maxed)
        hi = rows[:, :k].max(0).values.tolist() if k else []
        mean = (rows[:, k:].sum(0) / rows.shape[0]).tolist() if len(meaned) else []
        return hi, mean

    def _check(self, grad: torch.Tensor) -> dict | None:
        """Every ``check_every`` calls: share the window, refit the link, maybe decide again."""
        rows = self.window
        gaps = [r[2] for r in rows if r[2] >= 0] or [0.0]
        mine = [statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows),
                statistics.median(gaps)]
        if self.timings is not None:
            ev = self.timings(self, {"event": "window", "wire_s": mine[0], "total_s": mine[1], "gap_s": mine[2]})
            mine = [ev["wire_s"], ev["total_s"], ev["gap_s"]]
        keys = sorted(self._last_cost)  # the active candidate's last ledger (bytes differ by rank: the largest)
        hi, kept = self._gather(mine + [float(self._last_cost[k]) for k in keys], self._kept_local(grad))
        (wire, total, gap), self._last_cost = hi[:3], dict(zip(keys, hi[3:]))
        self.window = []
        n = grad.numel()
        cand = self.candidates[self.active]
        pred = self._predict(cand, n)
        ratio = (total + _EPS_S) / (pred + _EPS_S)
        self.measured.pop(cand.spec, None)  # the model's view for the refit below
        deviated = ratio > self.deviation or ratio < 1 / self.deviation
        periodic = self.since_decision >= self.decide_every or len(self.decisions) == 1
        level = "inter" if cand.reducer == "hier" else "flat"
        beta_before = self.link.get(level, self.link["flat"])[1]
        probed = (deviated or periodic) and self.probe and not self.declared
        if probed:  # measure the link again: a changed link shows here, CPU contention does not
            self._probe(n)
        self._refit(cand, wire, total, n, from_call=not probed)
        moved = self.link.get(level, self.link["flat"])[1] / max(beta_before, 1e-30)
        if (probed and (moved > 2 or moved < 0.5)) or (periodic and not deviated):
            self.measured.clear()  # times measured on the old link (or long ago) no longer hold
        self.measured[cand.spec] = total
        if deviated:
            why = (f"link changed (bandwidth x{1 / moved:.2f})" if moved > 2 or moved < 0.5
                   else "CPU time changed (the link did not)")
            return self._decide(n, gap, kept, f"measured {1e3 * total:.1f} ms per call vs predicted "
                                              f"{1e3 * pred:.1f} ms (x{ratio:.2f}): {why}")
        if periodic:
            return self._decide(n, gap, kept, "periodic" if len(self.decisions) > 1 else "first measurements")
        self._set_kept(kept)
        return None

    def _refit(self, cand: Candidate, wire: float, total: float, n: int, from_call: bool = True) -> None:
        """The measured call -> the estimates. ``from_call``: a bandwidth-bound call (its predicted
        ``beta * bytes`` at least its ``alpha * rounds``) refits the beta of the level it crossed from
        its wire time (when the latency term alone exceeds the measurement, both terms scale down);
        a latency-bound call says little about the link (its wire time is mostly waiting for the
        other ranks), so the link stays (the probe re-measures it). Then the reducer's CPU overhead
        per element = measured total - predicted wire: contention for cores lands there."""
        c = self._last_cost
        if cand.reducer == "hier":
            a, b = self.link.get("intra", self.link["flat"])
            wire = max(0.0, wire - a * c.get("intra_rounds", 0) - b * c.get("intra_bytes_received", 0))
            level, rounds, nbytes = "inter", c.get("inter_rounds", 0), c.get("inter_bytes_received", 0)
        else:
            level, rounds, nbytes = "flat", c.get("rounds", 0), c.get("bytes_received", 0)
        alpha, beta = self.link.get(level, self.link["flat"])
        pa, pb = alpha * rounds, beta * nbytes
        if from_call and pb >= pa and pb > 0:
            if wire > pa:
                beta = (wire - pa) / nbytes
            else:
                scale = wire / (pa + pb)
                alpha, beta = alpha * scale, beta * scale
            self.link[level] = [alpha, beta]
        self.cpu[cand.reducer] = max(0.0, total - self._wire(cand, n)) / max(1, n)

    # ------------------------------------------------------------------ the model and the decision
    def _cost(self, cand: Candidate, n: int) -> dict:
        P = self.comm.world_size
        vb = 2 if VALUE_DTYPES[cand.value_dtype] is not None else 4
        k = max(1, int(round(cand.density * n)))
        opts = self.candidate_options.get(cand.reducer, {})
        if cand.reducer == "hier":
            fp32 = REDUCERS.lookup("hier").predicted_cost(P, n, k, value_bytes=4, sites=self.layout, outer=cand.outer,
                                                          density=cand.density)
            half = REDUCERS.lookup("hier").predicted_cost(P, n, k, value_bytes=vb, sites=self.layout,
                                                          outer=cand.outer, density=cand.density)
            if fp32 is None or half is None:
                return {}
            return {"intra": fp32["intra"], "inter": half["inter"]}
        pc = REDUCERS.lookup(cand.reducer).predicted_cost(P, n, k, value_bytes=vb, **opts)
        return {"flat": pc} if pc is not None else {}

    def _wire(self, cand: Candidate, n: int) -> float:
        """``alpha * rounds + beta * bytes`` summed over the levels the candidate crosses."""
        t = 0.0
        for level, pc in self._cost(cand, n).items():
            alpha, beta = self.link.get(level, self.link["flat"])
            t += alpha * _mid(pc["rounds"]) + beta * _mid(pc["bytes_received"])
        return t

    def _predict(self, cand: Candidate, n: int) -> float:
        """The candidate's time per call: what it measured since the last link change when it ran
        then, else the model (wire + CPU overhead)."""
        if cand.spec in self.measured:
            return self.measured[cand.spec]
        per = self.cpu.get(cand.reducer, CPU_PRIOR_S.get(cand.reducer, CPU_PRIOR_OTHER))
        return self._wire(cand, n) + per * n

    def _set_kept(self, kept: list[float]) -> None:
        """The kept mass the next decision uses. Under error feedback the accumulated vector spreads
        (its residual holds what was not sent), so a density keeps less of it than of a fresh gradient
        (digits MLP, 1 %: 0.6 fresh, 0.19 after five steps with error feedback): while a dense
        candidate runs (no residual) the last measurement under a sparse one stands in."""
        now = dict(zip(self.densities, kept))
        if self.active is not None and self.candidates[self.active].sparse:
            self.kept_ef = now
        self.kept = self.kept_ef if (self.kept_ef and self.active is not None
                                     and not self.candidates[self.active].sparse) else now

    def _decide(self, n: int, gap: float, kept: list[float], reason: str) -> dict:
        """Score every candidate (same inputs on every rank: the same result), switch if needed."""
        self._set_kept(kept)
        pred, score, pen = {}, {}, {}
        for c in self.candidates:
            t = self._predict(c, n)
            km = self._kept_at(c.density) if c.sparse else 1.0
            pen[c.spec] = penalty_factor(km, self.penalty) if c.sparse else 1.0
            pred[c.spec] = 1e3 * t
            score[c.spec] = 1e3 * pen[c.spec] * (gap + t)
        order = sorted(range(len(self.candidates)), key=lambda i: (score[self.candidates[i].spec], i))
        best = order[0]
        if self.active is not None:
            cur = score[self.candidates[self.active].spec]
            if cur <= score[self.candidates[best].spec] * (1 + self.margin):
                best = self.active
        switched = best != self.active
        if switched:
            self._switch(best)
        d = {"step": self.step, "reason": reason, "chosen": self.choice, "switched": switched,
             "predicted_ms": {k: round(v, 3) for k, v in pred.items()},
             "score_ms": {k: round(v, 3) for k, v in score.items()},
             "penalty": {k: round(v, 4) for k, v in pen.items()},
             "kept": {f"{d:g}": round(v, 4) for d, v in self.kept.items()}, "gap_ms": round(1e3 * gap, 3),
             "link": {k: [float(a), float(b)] for k, (a, b) in self.link.items()}}
        self.last_decision = d
        self.decisions.append({k: d[k] for k in ("step", "reason", "chosen", "switched")})
        self.since_decision = 0
        return d

    def _kept_at(self, density: float) -> float:
        if density in self.kept:
            return self.kept[density]
        ds = sorted(self.kept)  # a candidate at another density: the nearest measured one below it
        below = [d for d in ds if d <= density]
        return self.kept[below[-1]] if below else (self.kept[ds[0]] if ds else 1.0)

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
        self._fresh = True

    # ------------------------------------------------------------------ state
    def _extra_state(self) -> dict:
        return {"candidates": [c.spec for c in self.candidates], "active": self.active,
                "link": {k: list(v) for k, v in self.link.items()}, "cpu": dict(self.cpu),
                "measured": dict(self.measured),
                "window": [list(r) for r in self.window], "kept": dict(self.kept), "kept_ef": dict(self.kept_ef),
                "since_decision": self.since_decision, "fresh": self._fresh, "last_cost": dict(self._last_cost),
                "decisions": list(self.decisions),
                "last_decision": self.last_decision,
                "carry": None if self._carry is None else self._carry.detach().cpu().clone(),
                "candidate": None if self._cand is None else self._cand.state_dict()}

    def _load_extra_state(self, d: dict) -> None:
        specs = [c.spec for c in self.candidates]
        if d.get("candidates") is not None and d["candidates"] != specs:
            raise ValueError(f"auto state was saved with candidates {d['candidates']}, this reducer has {specs}")
        self.link = {k: list(v) for k, v in (d.get("link") or {}).items()}
        self.cpu = dict(d.get("cpu") or {})
        self.measured = dict(d.get("measured") or {})
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
        self._fresh = bool(d.get("fresh", False))
        self._last_cost = dict(d.get("last_cost") or {})
        self._last_end = None

    @classmethod
    def predicted_cost(cls, P, n, k=None, value_bytes=4, index_bytes=4, **_):
        return None  # depends on the choice made at run time


def _listed(v):
    """A list option given as one string (``"a/b"``, ``"a,b"``, ``"a;b"``) or a single value, as a list."""
    if isinstance(v, str):
        return [p.strip() for p in v.replace(";", ",").replace("/", ",").split(",") if p.strip()]
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _mid(v) -> float:
    return 0.5 * (v[0] + v[1]) if isinstance(v, tuple) else float(v)


def _conserving(c: Candidate) -> bool:
    cls = REDUCERS.lookup(c.outer or c.reducer)
    return bool(cls.conserving) and (VALUE_DTYPES[c.value_dtype] is None or cls.value_dtype_conserving)
