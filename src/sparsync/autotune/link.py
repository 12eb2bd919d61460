"""The link and time model of the ``auto`` reducer (:mod:`sparsync.reducers.auto`): a probe fits
latency ``alpha`` and inverse bandwidth ``beta`` per level to timed ring all-reduces of two sizes
(``t = alpha * rounds + beta * bytes``, Hockney's model), a measured call refits them and the
reducer's CPU overhead per element, and a candidate's predicted time per call is its registered
``predicted_cost`` priced on that link plus its overhead.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ..reducers.base import VALUE_DTYPES
from ..reducers.registry import REDUCERS
from .candidates import Candidate

__all__ = ["CPU_PRIOR_S", "CPU_PRIOR_OTHER", "HALF_SUM_PRIOR_S", "LEVELS", "LINK_MOVED", "LinkModel", "PROBE_SURE_S",
           "RECHECK_S", "cpu_key", "mid"]

#: CPU seconds per gradient element of a reducer until it has been measured (select, error feedback,
#: copies; a 2-core machine with 4 ranks); a measured value replaces them
CPU_PRIOR_S = {"dense": 1e-9, "micro": 5e-9, "hier": 6e-9}
CPU_PRIOR_OTHER = 8e-9
#: extra CPU seconds per element of a dense exchange in half precision on a CPU process group: two
#: casts, and gloo adds half-precision values one at a time in software (on a fast link the half
#: exchange can take longer than the fp32 one)
HALF_SUM_PRIOR_S = 1e-8
LEVELS = ("flat", "intra", "inter")
#: probe sizes in values: the latency call, the first bandwidth call, its largest size, and how many
#: times the small call's time the bandwidth call must take before it is large enough
PROBE_SMALL, PROBE_START, PROBE_MAX, PROBE_RATIO = 256, 16384, 1 << 21, 4.0
#: a bandwidth call at least this long stops the probe at once; a shorter one (a few ms of a rank
#: descheduled can make it look bandwidth-bound) must be confirmed on twice its size
PROBE_SURE_S = 0.02
#: a probed bandwidth (or a re-check's call time) that moved by more than this factor is a changed link
LINK_MOVED = 2.0
#: what a re-check's call takes on the link as probed (at least :data:`PROBE_START` values): a rate
#: drop of 3x or more moves it past :data:`LINK_MOVED` even where latency is half of it
RECHECK_S = 0.01


def _prior(cand: Candidate, device_type: str = "cpu") -> float:
    """A candidate's CPU seconds per element until measured: its reducer's, plus the software
    half-precision sum for a dense exchange in fp16/bf16 on CPU."""
    base = CPU_PRIOR_S.get(cand.reducer, CPU_PRIOR_OTHER)
    if cand.reducer == "dense" and cand.value_dtype != "fp32" and device_type == "cpu":
        base += HALF_SUM_PRIOR_S
    return base


def cpu_key(cand: Candidate) -> str:
    """What a measured CPU overhead is filed under: the reducer (with hier's outer one) and the value
    precision - not the density (selection and error feedback cost per element alike at 1 and 5 %),
    but half values, which cost casts everywhere and a software sum in a dense exchange, apart."""
    parts = [cand.reducer] + ([cand.outer] if cand.outer else [])
    return ":".join(parts + ([cand.value_dtype] if cand.value_dtype != "fp32" else []))


def _level(cand: Candidate) -> str:
    """The level a candidate's payload crosses: between the sites for ``hier``, else the whole group."""
    return "inter" if cand.reducer == "hier" else "flat"


class LinkModel:
    """The link part of :class:`~sparsync.reducers.auto.AutoReducer` (a mixin: it reads and writes the
    reducer's ``link``, ``probe_calls`` and ``cpu``, reads ``comm``, ``layout``,
    ``measured``, ``candidate_options``, ``probe_repeats``, ``timings`` and ``_last_cost``, and
    gathers with ``_gather``)."""

    # ------------------------------------------------------------------ (a) probe
    def _probe(self, n: int) -> float:
        """Fit alpha, beta per level from timed ring all-reduces of two sizes (maximum over ranks).

        The small size (:data:`PROBE_SMALL` values) measures latency; the large one starts at
        :data:`PROBE_START` values and grows 8x, up to ``min(n, PROBE_MAX)``, until its call takes
        :data:`PROBE_RATIO` times the small one's (bandwidth, not latency, dominates it) and, when it
        took less than :data:`PROBE_SURE_S`, so does the call of twice its size, which the fit then
        uses (a short call slowed by a rank that lost its core for a few milliseconds would otherwise
        stop the probe early and read a fast link as a slow one): on a slow link the probe stops at
        64-128 KB, on a fast one it grows until the bytes show. Each growth is decided from the
        maximum over ranks (one small all-gather), so every rank sends the same sizes."""
        t0 = time.perf_counter()
        P = self.comm.world_size
        levels = self._levels()
        small, cap = PROBE_SMALL, max(PROBE_START, min(n, PROBE_MAX))
        mine, sizes = [], []
        for level, c in levels:
            t_small = self._timed_allreduce(level, c, small)
            large, seen, expect = PROBE_START, False, 0.0
            while True:
                # a call expected to take PROBE_SURE_S or more is timed once: a few ms of a rank off
                # its core cannot dominate it (the expectation comes from gathered times: every rank
                # makes the same number of calls)
                t_large = self._timed_allreduce(level, c, large, once=expect >= PROBE_SURE_S)
                if large >= cap:
                    break
                worst_small, worst_large = self._gather([t_small, t_large], [])[0]
                if worst_large >= PROBE_RATIO * worst_small:
                    # a short call may be a rank off its core for a few ms: confirmed on twice the size
                    if seen or worst_large >= PROBE_SURE_S:
                        break
                    seen, grow = True, 2
                else:
                    seen, grow = False, 8
                expect = worst_large * min(cap, grow * large) / large  # the bytes' share grows with the size
                large = min(cap, grow * large)
            mine += [t_small, t_large]
            sizes.append(large)
        worst = self._gather(mine, [])[0]
        self.probe_calls = {}
        for i, (level, c) in enumerate(levels):
            p, large = c.world_size, sizes[i]
            t_s, t_l = worst[2 * i], worst[2 * i + 1]
            rounds = max(1, 2 * (p - 1))
            b_s, b_l = (2 * (p - 1) * 4 * small / p, 2 * (p - 1) * 4 * large / p) if p > 1 else (0, 1)
            # on shared cores the small call can come out as slow as the large one: the large call's
            # own time per byte (half of it) bounds beta from below
            beta = max(1e-12, (t_l - t_s) / max(1.0, b_l - b_s), 0.5 * t_l / max(1.0, b_l))
            alpha = max(1e-7, (t_s - beta * b_s) / rounds)
            self.link[level] = [alpha, beta]
            # what a re-check times: a size halved from the bandwidth call's until the two calls put
            # it (linear in the size between them) at most RECHECK_S - on a link 10x slower it costs
            # ~10x that, not 10x the bandwidth call -, and the time they put it at
            slope, check = max(0.0, t_l - t_s) / max(1, large - small), large
            while check // 2 >= PROBE_START and t_s + slope * (check - small) > RECHECK_S:
                check //= 2
            self.probe_calls[level] = [check, t_s + slope * (check - small)]
        if P == 1:
            self.link["flat"] = [0.0, 0.0]
        return time.perf_counter() - t0

    def _levels(self) -> list:
        """(name, communicator) of every level the probe measures: the whole group; with several sites
        of several ranks also inside a site and across the sites (one rank of each site)."""
        levels = [("flat", self.comm)]
        if self.layout is not None and len(self.layout) > 1 and len(self.layout[0]) > 1:
            s = len(self.layout[0])
            levels.append(("intra", self.comm.split(self.layout)))
            levels.append(("inter", self.comm.split([[site[j] for site in self.layout] for j in range(s)])))
        return levels

    def _link_moved_quick(self) -> float:
        """A re-check of the link, much cheaper than a probe: per level one all-reduce of the size
        the probe chose for it (:attr:`probe_calls`: about :data:`RECHECK_S` on the probed link),
        timed once. Returns the largest factor by which a level's time moved, either way (maximum
        over ranks; every rank gets the same); infinity when there is no probe to compare with.
        Its time is measured under whatever load the machine has then, like the probe's it is
        compared with: a probe taken on a loaded machine reads the link slower than it is."""
        calls = self.probe_calls
        levels = [(name, c) for name, c in self._levels() if name in calls]
        if not levels:
            return math.inf
        times = [self._timed_allreduce(name, c, int(calls[name][0]), once=True) for name, c in levels]
        worst = self._gather(times, [])[0]
        then = [max(float(calls[name][1]), 1e-9) for name, _ in levels]
        return max(max(t / b, b / max(t, 1e-9)) for t, b in zip(worst, then))

    def _timed_allreduce(self, level: str, c, size: int, once: bool = False) -> float:
        """The fastest of ``probe_repeats`` all-reduces (``once``: one) of ``size`` values on ``c``
        (each after a barrier, off the ledger)."""
        buf = torch.ones(size, device=self.comm.device)
        best = math.inf
        for _ in range(1 if once else self.probe_repeats):
            self.comm.barrier()
            a = time.perf_counter()
            with c.unrecorded():
                c.allreduce(buf, out=buf)
            best = min(best, time.perf_counter() - a)
        if self.timings is not None:
            best = self.timings(self, {"event": "probe", "level": level, "numel": size, "time_s": best})["time_s"]
        return best

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
        self.cpu[cpu_key(cand)] = max(0.0, total - self._wire(cand, n)) / max(1, n)

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
            t += alpha * mid(pc["rounds"]) + beta * mid(pc["bytes_received"])
        return t

    def _beta(self, cand: Candidate) -> float:
        """Inverse bandwidth now of the level the candidate's payload crosses (between sites for hier)."""
        return self.link.get(_level(cand), self.link["flat"])[1]

    def _predict(self, cand: Candidate, n: int) -> float:
        """The candidate's time per call: what it measured since the last link change when it ran
        then, else the model (wire + CPU overhead)."""
        if self.measured.get(cand.spec):
            return statistics.median(self.measured[cand.spec])
        per = self.cpu.get(cpu_key(cand))
        if per is None:
            per = _prior(cand, self.comm.device.type) * self._machine_factor(cand)
        return self._wire(cand, n) + per * n

    def _machine_factor(self, cand: Candidate) -> float:
        """How much slower than its prior this machine runs the sparse reducers measured so far (the
        median of measured / prior): an unmeasured sparse reducer's prior is scaled by it, so that a
        loaded machine, measured on one reducer, does not make the others look cheap. 1 for dense
        (its CPU is copies, not selection) and before any sparse reducer has run."""
        if cand.reducer == "dense":
            return 1.0
        sparse = {cpu_key(c): c for c in self.candidates if c.reducer != "dense"}
        ratios = [self.cpu[k] / _prior(c, self.comm.device.type) for k, c in sparse.items() if k in self.cpu]
        return statistics.median(ratios) if ratios else 1.0


def mid(v) -> float:
    return 0.5 * (v[0] + v[1]) if isinstance(v, tuple) else float(v)

