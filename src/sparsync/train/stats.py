"""Statistics of repeated comparisons: medians, bootstrap intervals, paired ratios, verdicts, and
the time at which a held-out metric crosses its target.

Every function here is pure (numpy, no torch, no files) and deterministic: the bootstrap draws
from its own seeded generator, so the same runs give the same report.

* :func:`interval` - the median of a sample and a percentile-bootstrap interval of that median
  (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13: resample the values with
  replacement, take the median of each resample, report the 2.5th and 97.5th percentiles). With
  fewer than about six values the 95 % interval of the median is the sample's range (each end
  value is the median of more than 2.5 % of the resamples), which is what it should say.
* :func:`paired_ratios` - ratios of a row to a baseline *within each round* (same repeat, same
  seed), so that a slow minute of the machine, which hits both rows of a round, cancels.
* :func:`decide` - ``"yes"`` / ``"no"`` / ``"not decided"`` for a goal of the form
  ``value <= goal`` (or ``>=``) given an interval: undecided when the interval straddles the goal.
* :func:`crossing` - when (wall-clock and steps) a metric first reaches its target, linearly
  interpolated between the last evaluation before and the first at or past the target; works for
  a metric that goes up (accuracy) or down (a loss).

Values that never happened (a run that did not reach the target) enter as ``math.inf``: they sort
last, so a median or an interval end can be ``inf`` ("not reached"), and a ratio with an ``inf``
numerator is ``inf``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["BOOT_SEED", "HIGHER_IS_BETTER", "Interval", "crossing", "decide", "interval", "median",
           "paired_ratios"]

#: the bootstrap's fixed seed: a report is reproducible from its runs
BOOT_SEED = 20240229
#: the direction of each held-out metric a target can be set on (``True``: higher is better)
HIGHER_IS_BETTER = {"accuracy": True, "loss": False, "test_loss": False, "perplexity": False}


def median(values: Sequence[float]) -> float:
    """The median (mean of the two middle values for an even count); ``inf`` values sort last."""
    v = sorted(values)
    if not v:
        raise ValueError("median of an empty sample")
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


class Interval(tuple):
    """``(median, low, high, n)`` of one quantity over ``n`` runs; ``low <= median <= high``."""

    __slots__ = ()

    def __new__(cls, mid: float, lo: float, hi: float, n: int):
        return super().__new__(cls, (mid, lo, hi, n))

    mid = property(lambda s: s[0])
    lo = property(lambda s: s[1])
    hi = property(lambda s: s[2])
    n = property(lambda s: s[3])

    def to_dict(self) -> dict:
        f = lambda x: None if x is None or math.isinf(x) else x  # JSON has no inf: "not reached"
        return {"median": f(self.mid), "low": f(self.lo), "high": f(self.hi), "n": self.n}

    def format(self, fmt=lambda x: f"{x:.2f}", inf: str = "not reached") -> str:
        """``"1.23 [1.10, 1.40]"``; one value only: just the value; ``inf`` ends: ``inf``'s text."""
        s = lambda x: inf if math.isinf(x) else fmt(x)
        if self.n <= 1 or self.lo == self.hi == self.mid:
            return s(self.mid)
        return f"{s(self.mid)} [{s(self.lo)}, {s(self.hi)}]"


def interval(values: Iterable[float | None], level: float = 0.95, n_boot: int = 2000,
             seed: int = BOOT_SEED) -> Interval | None:
    """Median of ``values`` and the percentile-bootstrap ``level`` interval of the median
    (``n_boot`` resamples from a generator seeded with ``seed``). ``None`` entries are runs that
    never reached the quantity and count as ``inf``. Returns ``None`` for an empty sample. The
    interval always contains the median (it is widened to it if the resamples say otherwise)."""
    v = [math.inf if x is None else float(x) for x in values]
    if not v:
        return None
    mid = median(v)
    if len(v) == 1:
        return Interval(mid, mid, mid, 1)
    import numpy as np

    n = len(v)
    draws = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boots = np.sort(np.median(np.asarray(v)[draws], axis=1)).tolist()  # inf sorts last, as "not reached"
    a = (1 - level) / 2
    lo = boots[max(0, min(n_boot - 1, math.floor(a * n_boot)))]
    hi = boots[max(0, min(n_boot - 1, math.ceil((1 - a) * n_boot) - 1))]
    return Interval(mid, min(lo, mid), max(hi, mid), n)


def paired_ratios(rows: dict, base: dict) -> list[float]:
    """``rows[k] / base[k]`` for every round ``k`` both have (dicts: round -> value, ``None`` =
    never reached = ``inf``). A round where the baseline never reached gives ``0`` when the row did
    (infinitely faster) and is left out when neither did (no information)."""
    out = []
    for k in sorted(set(rows) & set(base), key=str):
        x = math.inf if rows[k] is None else float(rows[k])
        b = math.inf if base[k] is None else float(base[k])
        if math.isinf(b):
            if not math.isinf(x):
                out.append(0.0)
            continue
        out.append(math.inf if math.isinf(x) else x / b if b > 0 else math.inf)
    return out


def decide(iv: Interval | None, goal: float, at_most: bool = True) -> str:
    """``"yes"`` when the whole interval meets ``value <= goal`` (``at_most``; else ``>=``), ``"no"``
    when none of it does, ``"not decided"`` when it straddles the goal (or there is no interval)."""
    if iv is None:
        return "not decided"
    lo, hi = iv.lo, iv.hi
    if at_most:
        return "yes" if hi <= goal else "no" if lo > goal else "not decided"
    return "yes" if lo >= goal else "no" if hi < goal else "not decided"


def crossing(evals: Sequence[dict], target: float, metric: str = "accuracy",
             higher: bool | None = None) -> dict | None:
    """When ``metric`` first reaches ``target`` along ``evals`` (dicts with ``step`` - the 0-based
    step after which the evaluation ran - ``time_s`` - training wall-clock then - and ``metric``).

    Returns ``{"time_s", "steps", "eval_time_s", "eval_steps"}`` or ``None`` when never reached.
    ``steps`` counts steps done (``step + 1``). ``time_s`` / ``steps`` are linearly interpolated
    between the last evaluation short of the target and the first that reaches it, so a coarse
    evaluation grid does not round every row up to its next grid point; ``eval_*`` are that first
    evaluation's own values. When the very first evaluation already reaches the target there is
    nothing to interpolate from and its values are returned as they are. ``higher`` defaults from
    :data:`HIGHER_IS_BETTER` (a loss target is reached going down)."""
    if higher is None:
        higher = HIGHER_IS_BETTER.get(metric, True)
    reached = (lambda v: v >= target) if higher else (lambda v: v <= target)
    prev = None
    for e in evals:
        v = e.get(metric)
        if v is None or not math.isfinite(float(v)):
            continue
        if reached(v):
            t1, s1 = float(e["time_s"]), float(e["step"]) + 1
            out = {"time_s": t1, "steps": s1, "eval_time_s": t1, "eval_steps": s1}
            if prev is not None:
                v0, t0, s0 = prev
                f = (target - v0) / (v - v0)  # v0 is short of the target and v is not: 0 < f <= 1
                out["time_s"], out["steps"] = t0 + f * (t1 - t0), s0 + f * (s1 - s0)
            return out
        prev = (float(v), float(e["time_s"]), float(e["step"]) + 1)
    return None
