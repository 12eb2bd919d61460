"""The time model of the ``auto`` reducer (:mod:`sparsync.reducers.auto`): what a candidate's call is
predicted to take on this machine before it has run.

:class:`Link` holds latency ``alpha`` and inverse bandwidth ``beta`` per level (``flat``: the whole
group; with several sites of several ranks also ``intra`` and ``inter``), declared or probed: timed
ring all-reduces of two sizes fitted to ``t = alpha * rounds + beta * bytes`` (Hockney, "The
communication challenge for MPP", Parallel Computing 1994), the maximum over ranks. A candidate's
wire time is its registered ``predicted_cost`` priced on that link; its CPU time per element is a
prior (:data:`CPU_PRIOR_S`) until its reducer has run. :meth:`Link.recheck` re-times one call per
level against what the probe put it at: far cheaper than a probe, it says whether the link moved.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ..reducers.base import VALUE_DTYPES
from ..reducers.registry import REDUCERS
from .candidates import Candidate

__all__ = ["CPU_PRIOR_S", "CPU_PRIOR_OTHER", "HALF_SUM_PRIOR_S", "LINK_MOVED", "PROBE_MAX", "PROBE_START",
           "PROBE_SURE_S", "RECHECK_S", "Link", "cpu_key", "cpu_per_element", "cpu_prior", "max_and_mean", "mid"]

#: CPU seconds per gradient element of a reducer until it has been measured (select, error feedback,
#: copies); a measured value replaces them
CPU_PRIOR_S = {"dense": 1e-9, "micro": 5e-9, "hier": 6e-9}
CPU_PRIOR_OTHER = 8e-9
#: extra CPU seconds per element of a dense exchange in half precision on a CPU process group: two
#: casts, and gloo adds half-precision values one at a time in software
HALF_SUM_PRIOR_S = 1e-8
#: probe sizes in values: the latency call, the first bandwidth call, its largest size, and how many
#: times the small call's time the bandwidth call must take before it is large enough
PROBE_SMALL, PROBE_START, PROBE_MAX, PROBE_RATIO = 256, 16384, 1 << 21, 4.0
#: a bandwidth call at least this long stops the probe at once; a shorter one (a few ms of a rank
#: descheduled can make it look bandwidth-bound) must be confirmed on twice its size
PROBE_SURE_S = 0.02
#: a link whose re-check call or probed bandwidth moved by more than this factor has changed
LINK_MOVED = 2.0
#: what a re-check's call takes on the link as probed (at least :data:`PROBE_START` values)
RECHECK_S = 0.01


def max_and_mean(comm, maxed: list[float], meaned: list[float]) -> tuple[list[float], list[float]]:
    """(maximum over ranks of ``maxed``, mean over ranks of ``meaned``), the same on every rank: one
    all-gather of control data, combined in rank order."""
    mine = torch.tensor(list(maxed) + list(meaned), dtype=torch.float64, device=comm.device)
    if comm.world_size == 1 or mine.numel() == 0:
        return list(maxed), list(meaned)
    rows = torch.stack([t.reshape(-1).cpu() for t in comm.allgather_control(mine)])
    k = len(maxed)
    hi = rows[:, :k].max(0).values.tolist() if k else []
    mean = (rows[:, k:].sum(0) / rows.shape[0]).tolist() if len(meaned) else []
    return hi, mean


def cpu_key(cand: Candidate) -> str:
    """What a measured CPU cost is filed under: the reducer (with hier's outer one) and the value
    precision, not the density (selection and error feedback cost per element alike at 1 and 5 %)."""
    parts = [cand.reducer] + ([cand.outer] if cand.outer else [])
    return ":".join(parts + ([cand.value_dtype] if cand.value_dtype != "fp32" else []))


def cpu_prior(cand: Candidate, device_type: str = "cpu") -> float:
    """A candidate's CPU seconds per element until measured: its reducer's, plus the software
    half-precision sum for a dense exchange in fp16/bf16 on CPU."""
    base = CPU_PRIOR_S.get(cand.reducer, CPU_PRIOR_OTHER)
    if cand.reducer == "dense" and cand.value_dtype != "fp32" and device_type == "cpu":
        base += HALF_SUM_PRIOR_S
    return base


def cpu_per_element(cand: Candidate, measured: dict, candidates, device_type: str = "cpu") -> float:
    """A candidate's CPU seconds per element: its :func:`cpu_key`'s ``measured`` one, else its prior
    scaled by how much slower than their priors the measured sparse reducers ran (the median ratio;
    not for dense, whose CPU time is copies), so that a loaded machine does not make an unmeasured
    reducer look cheap."""
    if cpu_key(cand) in measured:
        return measured[cpu_key(cand)]
    sparse = {cpu_key(c): c for c in candidates if c.reducer != "dense"}
    slow = [measured[k] / cpu_prior(c, device_type) for k, c in sparse.items() if k in measured]
    return cpu_prior(cand, device_type) * (statistics.median(slow) if slow and cand.reducer != "dense" else 1.0)


def mid(v) -> float:
    return 0.5 * (v[0] + v[1]) if isinstance(v, tuple) else float(v)


class Link:
    """alpha, beta per level (``levels``), declared (``declared``: never probed) or probed.
    ``hook(event) -> event`` may replace a timed probe call (tests)."""

    def __init__(self, comm, layout, repeats: int = 2, declared: dict | None = None, hook=None):
        self.comm, self.layout, self.repeats, self.hook = comm, layout, repeats, hook
        self.declared = declared is not None
        self.levels: dict[str, list[float]] = {k: [float(a), float(b)] for k, (a, b) in dict(declared or {}).items()}
        self.checks: dict[str, list] = {}  # per level the re-check's call: [values, seconds]

    def groups(self) -> list:
        """(level, communicator) of every level: the whole group; with several sites of several ranks
        also inside a site and across the sites (one rank of each site)."""
        out = [("flat", self.comm)]
        if self.layout is not None and len(self.layout) > 1 and len(self.layout[0]) > 1:
            s = len(self.layout[0])
            out.append(("intra", self.comm.split(self.layout)))
            out.append(("inter", self.comm.split([[site[j] for site in self.layout] for j in range(s)])))
        return out

    def probe(self, n: int) -> float:
        """Fit alpha, beta per level; returns the seconds it took. The latency call has
        :data:`PROBE_SMALL` values; the bandwidth call starts at :data:`PROBE_START` and grows 8x, up
        to ``min(n, PROBE_MAX)``, until it takes :data:`PROBE_RATIO` times the latency call and, when
        shorter than :data:`PROBE_SURE_S`, so does twice its size (a rank off its core for a few ms
        must not stop it early). Each growth follows the maximum over ranks: every rank sends the
        same sizes."""
        t0 = time.perf_counter()
        groups, small, cap = self.groups(), PROBE_SMALL, max(PROBE_START, min(n, PROBE_MAX))
        mine, sizes = [], []
        for level, c in groups:
            t_small = self._timed(level, c, small)
            large, seen, expect = PROBE_START, False, 0.0
            while True:
                t_large = self._timed(level, c, large, once=expect >= PROBE_SURE_S)
                if large >= cap:
                    break
                worst_small, worst_large = max_and_mean(self.comm, [t_small, t_large], [])[0]
                if worst_large >= PROBE_RATIO * worst_small:
                    if seen or worst_large >= PROBE_SURE_S:
                        break
                    seen, grow = True, 2
                else:
                    seen, grow = False, 8
                expect = worst_large * min(cap, grow * large) / large
                large = min(cap, grow * large)
            mine += [t_small, t_large]
            sizes.append(large)
        worst = max_and_mean(self.comm, mine, [])[0]
        self.checks = {}
        for i, (level, c) in enumerate(groups):
            p, large, t_s, t_l = c.world_size, sizes[i], worst[2 * i], worst[2 * i + 1]
            b_s, b_l = (2 * (p - 1) * 4 * small / p, 2 * (p - 1) * 4 * large / p) if p > 1 else (0, 1)
            # on shared cores the small call can be as slow as the large one: half the large call's
            # time per byte bounds beta from below
            beta = max(1e-12, (t_l - t_s) / max(1.0, b_l - b_s), 0.5 * t_l / max(1.0, b_l))
            self.levels[level] = [max(1e-7, (t_s - beta * b_s) / max(1, 2 * (p - 1))), beta]
            # the re-check's size: halved from the bandwidth call's until the fit puts it at RECHECK_S
            slope, check = max(0.0, t_l - t_s) / max(1, large - small), large
            while check // 2 >= PROBE_START and t_s + slope * (check - small) > RECHECK_S:
                check //= 2
            self.checks[level] = [check, t_s + slope * (check - small)]
        if self.comm.world_size == 1:
            self.levels["flat"] = [0.0, 0.0]
        return time.perf_counter() - t0

    def recheck(self) -> float:
        """One all-reduce per level of the size the probe put at :data:`RECHECK_S`, timed once: the
        largest factor by which a level's time moved either way (max over ranks); inf without a probe."""
        groups = [(level, c) for level, c in self.groups() if level in self.checks]
        if not groups:
            return math.inf
        now = max_and_mean(self.comm, [self._timed(lv, c, int(self.checks[lv][0]), once=True) for lv, c in groups],
                           [])[0]
        then = [max(float(self.checks[lv][1]), 1e-9) for lv, _ in groups]
        return max(max(t / b, b / max(t, 1e-9)) for t, b in zip(now, then))

    def _timed(self, level: str, c, size: int, once: bool = False) -> float:
        """The fastest of ``repeats`` all-reduces (``once``: one) of ``size`` values, each after a
        barrier, off the ledger."""
        buf, best = torch.ones(size, device=self.comm.device), math.inf
        for _ in range(1 if once else self.repeats):
            self.comm.barrier()
            a = time.perf_counter()
            with c.unrecorded():
                c.allreduce(buf, out=buf)
            best = min(best, time.perf_counter() - a)
        if self.hook is not None:
            best = self.hook({"event": "probe", "level": level, "numel": size, "time_s": best})["time_s"]
        return best

    def wire(self, cand: Candidate, n: int, options: dict | None = None) -> float:
        """``alpha * rounds + beta * bytes`` of the candidate's registered cost, summed over the
        levels it crosses (``options``: the reducers' options by name)."""
        P, vb = self.comm.world_size, 2 if VALUE_DTYPES[cand.value_dtype] is not None else 4
        k, opts = max(1, int(round(cand.density * n))), dict((options or {}).get(cand.reducer, {}))
        if cand.reducer == "hier":
            cost = REDUCERS.lookup("hier").predicted_cost
            fp32 = cost(P, n, k, value_bytes=4, sites=self.layout, outer=cand.outer, density=cand.density)
            half = cost(P, n, k, value_bytes=vb, sites=self.layout, outer=cand.outer, density=cand.density)
            costs = {} if fp32 is None or half is None else {"intra": fp32["intra"], "inter": half["inter"]}
        else:
            pc = REDUCERS.lookup(cand.reducer).predicted_cost(P, n, k, value_bytes=vb, **opts)
            costs = {} if pc is None else {"flat": pc}
        t = 0.0
        for level, pc in costs.items():
            alpha, beta = self.levels.get(level, self.levels["flat"])
            t += alpha * mid(pc["rounds"]) + beta * mid(pc["bytes_received"])
        return t

    def beta(self, cand: Candidate) -> float:
        """Inverse bandwidth of the level the candidate's payload crosses (between sites for hier)."""
        return self.levels.get("inter" if cand.reducer == "hier" else "flat", self.levels["flat"])[1]
