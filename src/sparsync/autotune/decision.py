"""The decision of the ``auto`` reducer (:mod:`sparsync.reducers.auto`): every ``check_every`` calls
the ranks share their window of measurements (one all-gather of control data: maximum of the times,
mean of the kept mass, so every rank holds the same inputs); the first window and a window off its
prediction re-check the link (one all-reduce per level) and probe it again where that moved, and every
``decide_every`` calls it is probed again; on a changed link, two windows off the same way or
every ``decide_every`` calls every candidate is scored
``penalty(kept) * (gap + t)``, with hysteresis ``margin``. The decision record (reason, predicted
and scored milliseconds per candidate, penalties, kept mass, link) goes to ``stats["auto"]``.
"""

from __future__ import annotations

import statistics

import torch

from .kept import penalty_factor
from .link import LINK_MOVED

__all__ = ["Decisions", "max_and_mean"]

_EPS_S = 5e-3  # slack in the deviation test: tiny wires do not trigger re-decisions on noise
_HISTORY = 8   # window medians kept per candidate (since the last link change)


def _side(t: float, pred: float, factor: float) -> int:
    """+1 / -1 when the time ``t`` is more than ``factor`` above / below the prediction (with
    :data:`_EPS_S` of slack), else 0."""
    ratio = (t + _EPS_S) / (pred + _EPS_S)
    return 1 if ratio > factor else -1 if ratio < 1 / factor else 0


def _moved_far(moved: float) -> bool:
    """Whether a bandwidth ratio (new beta / old beta) is a changed link."""
    return moved > LINK_MOVED or moved < 1 / LINK_MOVED


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


class Decisions:
    """The decision part of :class:`~sparsync.reducers.auto.AutoReducer` (a mixin: it uses the link
    model, the kept mass and the reducer's ``_switch``)."""

    # ------------------------------------------------------------------ (b) measurements
    def _gather(self, maxed: list[float], meaned: list[float]) -> tuple[list[float], list[float]]:
        return max_and_mean(self.comm, maxed, meaned)

    def _check(self, grad: torch.Tensor, alone: bool = False, beta_before: float | None = None) -> dict | None:
        """Every ``check_every`` calls: share the window, refit the link, maybe decide again.
        ``alone``: the watch saw this window's call far off - decide from it alone; ``beta_before``:
        the watch has just probed the link (and found it moved), this was its beta."""
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
        just_probed = beta_before is not None
        if not just_probed:
            beta_before = self._beta(cand)
        can_probe = self.probe and not self.declared
        pred = self._predict(cand, n)
        # the candidate's time: the median of its windows since the last link change, so that one
        # window slowed by a busy core neither moves it far nor triggers a re-decision alone; a
        # deviation is two windows in a row off the same way (the first measurement: that one alone)
        history = list(self.measured.pop(cand.spec, []))  # (popped: the model's view for the refit)
        if alone:
            history = []
        ratio = (total + _EPS_S) / (pred + _EPS_S)
        sides = {_side(t, pred, self.deviation) for t in history[-1:] + [total]}
        off = _side(total, pred, self.deviation) != 0
        deviated = alone or (len(sides) == 1 and off)
        if deviated:
            history = history[-1:]  # the candidate's time changed: the windows before no longer hold
        first = len(self.decisions) == 1  # the first window after the start: decide on measured times
        periodic = self.since_decision >= self.decide_every or first
        # A window off is re-checked at once - one call per level of the size the probe put at
        # RECHECK_S - and probed in full only when that moved: a changed link is decided on now, a
        # busy core waits for a second window. The first window is re-checked whatever its time (a
        # start probe that a rank off its core made read a fast link as a slow one shows there; a
        # first window off its prediction is otherwise the CPU priors meeting this machine). The
        # periodic decision probes in full.
        recheck = (deviated or off or first) and can_probe and not just_probed
        refresh = periodic and not first and can_probe and not just_probed
        probed = refresh or (recheck and _moved_far(self._link_moved_quick()))
        if probed:  # measure the link again: a changed link shows here, CPU contention does not
            self._probe(n)
        # where the link can be probed, only the probe measures it: a call's wire time holds its
        # waiting for slower ranks (a sparse call's mostly), which is CPU, not link - read as the link
        # it made every flat candidate look 4x slower than it was. A declared link is refitted from
        # bandwidth-bound calls.
        self._refit(cand, wire, total, n, from_call=not can_probe)
        moved = self._beta(cand) / max(beta_before, 1e-30)
        changed = _moved_far(moved)  # (a probed link moves only when probed)
        if changed or (periodic and not deviated):
            self.measured.clear()  # times measured on the old link (or long ago) no longer hold
            history = []
        self.measured[cand.spec] = (history + [total])[-_HISTORY:]
        if changed or deviated:  # a link that changed is a reason to decide again
            why = (f"link changed (bandwidth x{1 / moved:.2f})" if changed else
                   "first measurements (the start's probe stands)" if first else "CPU time changed (the link did not)")
            return self._decide(n, gap, kept, f"measured {1e3 * total:.1f} ms per call vs predicted "
                                              f"{1e3 * pred:.1f} ms (x{ratio:.2f}): {why}")
        if periodic:
            return self._decide(n, gap, kept, "first measurements" if first else "periodic")
        self._set_kept(kept)
        return None

    def _watch(self, grad: torch.Tensor) -> dict | None:
        """Between checks: the previous call's time (maximum over ranks) against what the active
        candidate measured. Off by more than ``watch``, the link is re-checked (one all-reduce per
        level) and, where that moved, probed: if its bandwidth moved by more than 2x the check runs
        now on that call alone; else it was the machine (a busy core),
        which the regular check weighs. A declared link cannot be probed: the check runs."""
        total = self._gather([self.window[-1][1]], [])[0][0]
        cand = self.candidates[self.active]
        if not _side(total, self._predict(cand, grad.numel()), self.watch):
            return None
        if not self.probe or self.declared:
            self.window = self.window[-1:]
            return self._check(grad, alone=True)
        beta = self._beta(cand)
        if not _moved_far(self._link_moved_quick()):  # the re-check's call took what it took: the machine
            return None
        self._probe(grad.numel())
        if _moved_far(self._beta(cand) / max(beta, 1e-30)):
            self.window = self.window[-1:]
            return self._check(grad, alone=True, beta_before=beta)
        return None

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
