"""``auto``: runs the candidate exchange that is fastest on this machine after its convergence cost.

``make_reducer("auto", comm)`` (``SparseDDP(m, comm, reducer="auto")``, ``ddp_hook("auto")``, ``sparsync
train --reducer auto``) hands every call to one *active* candidate reducer made through the registry
(each merge group its own). ``candidates``: e.g. ``"dense,dense:fp16,micro:0.01:fp16,hier:micro:0.01"``;
by default dense, dense fp16 and ``sparse`` at ``densities`` x ``values`` (also under ``hier`` with sites).

1. **Time.** A candidate's time per call: the median of its windows since the last link change or
   periodic decision; before it has one, ``alpha * rounds + beta * bytes`` on the probed (or declared,
   ``link=``) link plus its CPU time per element - its reducer's measured one, else a prior scaled
   by how much slower than theirs the measured sparse reducers ran.
2. **Cost.** ``score = penalty * (gap + time)``; ``gap``: the step's compute outside the call;
   ``penalty = 1 + c (1 - kept) / kept`` for a sparse candidate, 1 for dense.
3. **Choice.** The lowest score; the active candidate stays unless ``best * (1 + margin) < active``.
4. **Windows.** Every ``check_every`` calls the ranks share their window (its median, the maximum
   over ranks) once it holds ``check_every - 1`` measured calls; a run's first ``warmup`` calls and a
   new candidate's first call are not measured.
5. **Re-time.** A window more than ``deviation`` off the active candidate's time re-checks the link
   (one call per level), probed again if that moved 2x; a bandwidth moved 2x forgets every time and
   decides. Else decide at the second window in a row off the same way (or at the first window of a
   candidate not measured yet); one window off changes nothing.
6. **Periodic.** At the first window and ``decide_every`` calls after the last decision: re-check as
   in 5, forget the other candidates' times, decide.
7. **Same on every rank.** Decisions read all-gathered values only; ties go to the earlier candidate.
8. **Nothing lost.** A switch hands the old candidate's residual through auto's ``ErrorFeedback``
   into the new one's first input.

Helpers, one idea each: :mod:`sparsync.autotune.link` (the probe, the time model),
:mod:`sparsync.autotune.kept` (kept mass and penalty: sources, calibration), :mod:`sparsync.autotune.candidates`
(spellings). ``stats["auto"]``: the choice and, on a call that decided, the decision (reason, predicted and
scored ms, kept mass). ``timings`` (attribute, ``callable(reducer, event) -> event``): tests' times.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..autotune.candidates import Candidate, candidate_list, conserving, parse_candidate
from ..autotune.kept import PENALTY, KeptMass, penalty_factor
from ..autotune.link import LINK_MOVED, Link, cpu_key, cpu_per_element, max_and_mean
from ..sites import site_layout
from .base import Reducer
from .capabilities import OptionFact
from .registry import REDUCERS, make_reducer, register

__all__ = ["AutoReducer", "Candidate", "parse_candidate", "penalty_factor", "PENALTY", "conserving"]

_EPS_S = 5e-3  # slack in the deviation test: tiny calls do not trigger decisions on noise
_HISTORY = 8   # window times kept per candidate
_PASSED_STATS = ("select_s", "comm_s", "selected", "intra_bytes", "inter_bytes", "intra_bytes_received",
                 "inter_bytes_received", "intra_rounds", "inter_rounds", "sites")  # the candidate's, as auto's


def _side(t: float, ref: float, factor: float) -> int:
    """+1 / -1 when ``t`` is more than ``factor`` above / below ``ref`` (with :data:`_EPS_S` slack), else 0."""
    ratio = (t + _EPS_S) / (ref + _EPS_S)
    return 1 if ratio > factor else -1 if ratio < 1 / factor else 0


@register("auto")
class AutoReducer(Reducer):
    """See the module docstring. ``indexed_output`` (a candidate's :class:`~.base.IndexedSum`) and ``conserving``
    are rules on the candidates; the class reads the default set's (dense fp16 sums rounded values)."""

    indexed_output = OptionFact(True, lambda r: any(REDUCERS.lookup(c.reducer).indexed_output for c in r.candidates))
    conserving = OptionFact(False, lambda r: all(conserving(c) for c in r.candidates))

    def __init__(self, comm, density: float = 0.01, candidates=None, sparse: str = "micro",
                 densities=(0.01, 0.02, 0.05), values=("fp32", "fp16"), sites=None, decide_every: int = 50,
                 check_every: int = 5, deviation: float = 1.5, watch: float = 0.0, margin: float = 0.1,
                 warmup: int = 3, penalty: float = PENALTY, probe: bool = True, probe_repeats: int = 2,
                 link: dict | None = None, sample: int = 65536, candidate_options: dict | None = None,
                 value_dtype: str = "fp32", nonfinite: str = "error"):
        if value_dtype != "fp32":
            raise ValueError("auto chooses the value precision itself (values=...); do not pass value_dtype")
        super().__init__(comm, density=density, nonfinite=nonfinite)
        for k, v, lo in (("decide_every", decide_every, 1), ("check_every", check_every, 1), ("warmup", warmup, 1),
                         ("probe_repeats", probe_repeats, 1), ("sample", sample, 16)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"auto: {k} must be an integer >= {lo}, got {v!r}")
        for k, v, ok in (("deviation", deviation, lambda x: x > 1), ("margin", margin, lambda x: 0 <= x < 1),
                         ("penalty", penalty, lambda x: x >= 0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ValueError(f"auto: {k} out of range, got {v!r} (deviation > 1, 0 <= margin < 1, penalty >= 0)")
        if watch != 0:
            raise ValueError(f"auto: watch was removed (its all-gather per call cost more than it saved), got "
                             f"{watch!r}; a window off its prediction re-checks the link")
        if not probe and link is None:
            raise ValueError("auto: probe=False needs link={'flat': (alpha_s, beta_s_per_byte)}")
        if link is not None and "flat" not in dict(link):
            raise ValueError("auto: link= needs at least a 'flat' entry (alpha s, beta s/byte)")
        self.layout = site_layout(comm.world_size, sites)
        self.candidates, self.densities = candidate_list(candidates, density, sparse, densities, values, self.layout)
        self.candidate_options = dict(candidate_options or {})
        self.decide_every, self.check_every, self.warmup = decide_every, check_every, warmup
        self.deviation, self.margin, self.penalty = float(deviation), float(margin), float(penalty)
        self.probe = bool(probe) and link is None
        self.link = Link(comm, self.layout, probe_repeats, link, hook=self._event)
        self.kept = KeptMass(self.densities, sample)
        self.memory.on_nonfinite = None if nonfinite == "ignore" else self._carry_overflowed  # rule 8's carry only
        self.cpu: dict[str, float] = {}      # measured CPU seconds per element, per cpu_key
        self.measured: dict[str, list[float]] = {}  # window times per candidate (rule 1)
        self.pending: float | None = None    # the active candidate's last window, off and not confirmed
        self.window: list[list[float]] = []  # this rank's [total_s, gap_s] per measured call
        self.decisions, self.last_decision, self.timings = [], None, None
        self.active, self._cand, self._last_end, self.since_decision, self._fresh = None, None, None, 0, 0

    # ------------------------------------------------------------------ residual: the candidate's or the carried one
    @property
    def residual(self) -> torch.Tensor | None:
        carried, cand = self.memory.residual, self._cand
        return carried if carried is not None or cand is None else cand.residual

    @residual.setter
    def residual(self, value) -> None:
        self.memory.residual = value  # (one of the two is None at any time: the carry goes at the next call)
        if self._cand is not None:
            self._cand.residual = None

    @property
    def choice(self) -> str | None:
        """The active candidate's spelling (None before the first call)."""
        return None if self.active is None else self.candidates[self.active].spec

    def _event(self, ev: dict) -> dict:
        return ev if self.timings is None else self.timings(self, ev)

    def _carry_overflowed(self, values: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None and bool(torch.isfinite(values).all()):
            raise FloatingPointError(f"rank {self.comm.rank}: auto.reduce: the gradient is finite but its sum with "
                                     f"the residual carried from an earlier candidate is not (step {self.step})")
        self._raise_nonfinite(values)

    # ------------------------------------------------------------------ the call
    def _reduce(self, grad: torch.Tensor):
        t0 = time.perf_counter()
        gap = None if self._last_end is None else t0 - self._last_end
        if gap is None and self.compute_start is not None:  # the first call: the compute since it began
            gap = max(0.0, t0 - self.compute_start)
        decision = None
        if self.active is None:
            probe_s = self.link.probe(grad.numel()) if self.probe else 0.0
            (hint,), kept = max_and_mean(self.comm, [gap or 0.0], self._kept_local(grad, True))
            self.kept.update(kept, None)
            decision = {**self._decide(grad.numel(), hint, "start"), "probe_s": probe_s}
        elif self.step % self.check_every == 0 and len(self.window) >= max(1, self.check_every - 1):
            decision = self._check(grad)
        x = grad if self.memory.residual is None else self.memory.add(grad)  # rule 8: the carried residual
        out = self._cand.reduce(x, indexed=True, donate=self.donated or x is not grad)
        self.memory.residual = None  # the candidate took it (a call that raised took nothing)
        ev = self._event({"event": "call", "candidate": self.choice, "total_s": float(self._cand.stats["total_s"])})
        if not self._fresh:  # rule 4: a run's warm-up and a candidate's set-up are not measurements
            self.window.append([ev["total_s"], -1.0 if gap is None else gap])
        self._fresh, self.since_decision = max(0, self._fresh - 1), self.since_decision + 1
        self.stats.update({k: v for k, v in self._cand.stats.items() if k in _PASSED_STATS})
        self.stats["auto"] = {"choice": self.choice, **({"decision": decision} if decision else {})}
        self._last_end = time.perf_counter()
        return out

    def _kept_local(self, grad: torch.Tensor, fresh: bool) -> list[float]:
        """This rank's kept mass per density; while dense runs only for a periodic decision (``fresh``)."""
        if not any(c.sparse for c in self.candidates):
            return [1.0 for _ in self.densities]
        dense_now = self.active is not None and not self.candidates[self.active].sparse
        return self.kept.local(grad, self.residual, measure=fresh or not dense_now)

    def _check(self, grad: torch.Tensor) -> dict | None:
        """Rules 4-6 on the window just closed."""
        rows, self.window, n = self.window, [], grad.numel()
        gaps = [g for _, g in rows if g >= 0] or [0.0]
        ev = self._event({"event": "window", "total_s": statistics.median(t for t, _ in rows),
                          "gap_s": statistics.median(gaps)})
        first = len(self.decisions) == 1
        periodic = first or self.since_decision >= self.decide_every
        (total, gap), kept = max_and_mean(self.comm, [ev["total_s"], ev["gap_s"]], self._kept_local(grad, periodic))
        cand = self.candidates[self.active]
        self.kept.update(kept, cand.sparse)
        history, ref = self.measured.get(cand.spec, []), self._time(cand, n)
        side = _side(total, ref, self.deviation)
        confirmed = side != 0 and (not history or (self.pending is not None
                                                   and _side(self.pending, ref, self.deviation) == side))
        moved = 1.0
        if self.probe and (side or periodic):  # rule 5: a window off (or a periodic decision) re-checks the link
            beta = self.link.beta(cand)
            if self.link.recheck() > LINK_MOVED:
                self.link.probe(n)
                moved = self.link.beta(cand) / max(beta, 1e-30)
        changed = moved > LINK_MOVED or moved < 1 / LINK_MOVED
        if side and not (changed or periodic or confirmed):
            self.pending = total  # a single window off: not (yet) the candidate's time
            return None
        self.cpu[cpu_key(cand)] = max(0.0, total - self.link.wire(cand, n, self.candidate_options)) / max(1, n)
        if changed or periodic:
            self.measured, history = {}, []
        if confirmed and self.pending is not None:
            history = [self.pending]  # the candidate's time changed: the windows before no longer hold
        self.measured[cand.spec], self.pending = (history + [total])[-_HISTORY:], None
        if changed or confirmed:
            why = (f"link changed (bandwidth x{1 / moved:.2f})" if changed else "first measurements" if first
                   else "CPU time changed (the link did not)" if self.probe else "time changed (declared link)")
            return self._decide(n, gap, f"measured {1e3 * total:.1f} ms per call vs predicted {1e3 * ref:.1f} ms "
                                        f"(x{(total + _EPS_S) / (ref + _EPS_S):.2f}): {why}")
        return self._decide(n, gap, "first measurements" if first else "periodic") if periodic else None

    def _time(self, cand: Candidate, n: int) -> float:
        """Rule 1: the median of its measured windows, else the model."""
        if self.measured.get(cand.spec):
            return statistics.median(self.measured[cand.spec])
        per = cpu_per_element(cand, self.cpu, self.candidates, self.comm.device.type)
        return self.link.wire(cand, n, self.candidate_options) + per * n

    def _decide(self, n: int, gap: float, reason: str) -> dict:
        """Rules 2, 3 and 7: score every candidate on the gathered inputs, switch if needed."""
        pred, pen, score = {}, {}, []
        for c in self.candidates:
            pred[c.spec] = self._time(c, n)
            pen[c.spec] = penalty_factor(self.kept.at(c.density), self.penalty) if c.sparse else 1.0
            score.append(pen[c.spec] * (gap + pred[c.spec]))
        best, before = min(range(len(score)), key=lambda i: (score[i], i)), self.active
        if before is None or (best != before and score[best] * (1 + self.margin) < score[before]):
            self._switch(best)
        switched = self.active != before
        d = {"step": self.step, "reason": reason, "chosen": self.choice, "switched": switched,
             "predicted_ms": {k: round(1e3 * v, 3) for k, v in pred.items()},
             "score_ms": {c.spec: round(1e3 * s, 3) for c, s in zip(self.candidates, score)},
             "penalty": {k: round(v, 4) for k, v in pen.items()}, "gap_ms": round(1e3 * gap, 3),
             "kept": {f"{d:g}": round(v, 4) for d, v in self.kept.kept.items()},
             "link": {k: list(v) for k, v in self.link.levels.items()}}
        self.last_decision, self.since_decision = d, 0
        self.decisions.append({k: d[k] for k in ("step", "reason", "chosen", "switched")})
        return d

    def _switch(self, i: int) -> None:
        """Rule 8: the outgoing candidate's residual joins auto's carried one (through its memory)."""
        old, c = self._cand, self.candidates[i]
        if old is not None and old.residual is not None:
            self.memory.keep(self.memory.add(old.residual))
        opts = {**self.candidate_options.get(c.reducer, {}), **({} if c.value_dtype == "fp32" else
                                                                {"value_dtype": c.value_dtype})}
        if c.reducer == "hier":
            opts.update(outer=c.outer, sites=self.layout, **self.candidate_options.get(c.outer, {}))
        self._cand = make_reducer(c.reducer, self.comm, c.density, nonfinite=self.nonfinite, **opts)
        self._cand.step, self.active = self.step, i
        self._fresh = 1 if self.decisions else self.warmup

    # ------------------------------------------------------------------ state
    def _extra_state(self) -> dict:
        """The choice, the carried residual, the active candidate's state and the kept mass (what a
        bitwise resume restores) and, under ``timings``, the wall-clock readings decisions came from."""
        timings = {"link": {k: list(v) for k, v in self.link.levels.items()},
                   "probe_calls": {k: list(v) for k, v in self.link.checks.items()}, "cpu": dict(self.cpu),
                   "measured": {k: list(v) for k, v in self.measured.items()}, "pending": self.pending,
                   "window": [list(r) for r in self.window], "decisions": list(self.decisions),
                   "last_decision": self.last_decision}
        carry = self.memory.residual
        return {"candidates": [c.spec for c in self.candidates], "active": self.active,
                "kept": dict(self.kept.kept), "kept_ef": dict(self.kept.under_ef),
                "since_decision": self.since_decision, "fresh": self._fresh,
                "carry": None if carry is None else carry.detach().cpu().clone(),
                "candidate": None if self._cand is None else self._cand.state_dict(), "timings": timings}

    def _check_extra_state(self, d: dict, numel) -> None:
        specs = [c.spec for c in self.candidates]
        if d.get("candidates") is not None and d["candidates"] != specs:
            raise ValueError(f"auto state was saved with candidates {d['candidates']}, this reducer has {specs}")
        a, carry = d.get("active"), d.get("carry")
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < len(specs)):
            raise ValueError(f"auto state: active must be a candidate index in [0, {len(specs)}), got {a!r}")
        if carry is not None and not (isinstance(carry, torch.Tensor) and carry.dim() == 1 and carry.numel() == numel
                                      and carry.dtype.is_floating_point and bool(torch.isfinite(carry).all())):
            raise ValueError(f"auto state: the carried residual must be a finite 1-D float tensor of {numel} "
                             f"entries, got {getattr(carry, 'shape', type(carry).__name__)}")
        if d.get("candidate") is not None and a is None:
            raise ValueError("auto state: a candidate's state without an active candidate")
        for key, v in (("since_decision", d.get("since_decision", 0)), ("fresh", d.get("fresh", 0))):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"auto state: {key} must be an integer >= 0, got {v!r}")

    def _load_extra_state(self, d: dict) -> None:
        t = {**d, **(d.get("timings") or {})}
        if t.get("link"):  # (a state without one, e.g. another world size's: the link as it is)
            self.link.levels = {k: list(v) for k, v in t["link"].items()}
            self.link.checks = {k: list(v) for k, v in (t.get("probe_calls") or {}).items()}
        self.cpu = dict(t.get("cpu") or {})
        self.measured = {k: list(v) for k, v in (t.get("measured") or {}).items()}
        self.pending = t.get("pending")
        self.window = [list(r[-2:]) for r in t.get("window") or []]  # (older states: [wire, total, gap])
        self.decisions, self.last_decision = list(t.get("decisions") or []), t.get("last_decision")
        self.kept.kept, self.kept.under_ef = dict(d.get("kept") or {}), dict(d.get("kept_ef") or {})
        self.since_decision, self.active, self._cand = int(d.get("since_decision", 0)), None, None
        if d.get("active") is not None:
            self._switch(int(d["active"]))
            if d.get("candidate") is not None:
                self._cand.load_state_dict(d["candidate"])
        carry = d.get("carry")
        self.memory.residual = None if carry is None else carry.to(self.comm.device).clone()
        self._fresh, self._last_end = int(d.get("fresh", 0)), None
