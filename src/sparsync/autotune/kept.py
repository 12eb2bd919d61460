"""Kept mass and the convergence cost of low density, for the ``auto`` reducer
(:mod:`sparsync.reducers.auto`, whose docstring states the model, its calibration and its sources).

``kept(d)``: the share of the accumulated gradient's squared mass that the largest ``d`` share of
entries hold, measured on a fixed sample (one partial sort, vectorised). Without a residual (at the
start, or while a dense candidate runs) the accumulated vector is estimated: :func:`kept_under_feedback`
spreads the sample as error feedback would. :func:`penalty_factor` turns it
into expected steps relative to the exact exchange, ``1 + c (1 - kept) / kept`` (the first-order
term of error feedback's slow-down: Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory",
NeurIPS 2018; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019).
"""

from __future__ import annotations

import math

import torch

__all__ = ["PENALTY", "FEEDBACK_STEPS", "penalty_factor", "kept_under_feedback", "KeptMass"]

#: convergence cost coefficient c in ``1 + c (1 - kept) / kept``, calibrated on the
#: digits MLP (:mod:`sparsync.reducers.auto` docstring)
PENALTY = 0.09


#: steps of error feedback :func:`kept_under_feedback` applies to a gradient seen without a residual
FEEDBACK_STEPS = 2


def kept_under_feedback(x: torch.Tensor, k: int, steps: int = FEEDBACK_STEPS) -> float:
    """The kept mass of the largest ``k`` entries once error feedback has spread ``x``: the vector that
    accumulates when ``x`` arrives ``steps + 1`` times and each time its largest ``k`` entries are sent
    and the rest kept. A fresh gradient concentrates its mass (digits MLP: its top 1 / 2 / 5 % hold
    0.55 / 0.61 / 0.71); under error feedback the accumulated vector spreads as training goes on. Two
    steps on the frozen gradient give 0.19 / 0.25 / 0.38 there, the values measured under error
    feedback that calibrated :data:`PENALTY` (0.185 / 0.255 / 0.406). ``steps`` top-k passes of ``x``'s size."""
    acc = x.clone()
    for _ in range(steps):
        acc[acc.abs().topk(k, sorted=False).indices] = 0  # sent
        acc += x                                          # the next gradient on top of what was kept
    sq = acc * acc
    total = float(sq.sum())
    return float(sq.topk(k, sorted=False).values.sum()) / total if total > 0 else 1.0


def penalty_factor(kept: float, c: float = PENALTY) -> float:
    """Expected steps relative to an exact exchange when one step transmits the share ``kept`` of the
    accumulated gradient's squared mass: ``1 + c (1 - kept) / kept`` (module docstring)."""
    kept = min(1.0, max(1e-6, float(kept)))
    return 1.0 + c * (1.0 - kept) / kept


class KeptMass:
    """The kept-mass part of :class:`~sparsync.reducers.auto.AutoReducer` (a mixin: it reads the
    reducer's ``densities``, ``sample``, ``residual``, ``active``, ``candidates``, ``kept``,
    ``since_decision`` and ``decide_every``)."""

    def _kept_local(self, grad: torch.Tensor) -> list[float]:
        """This rank's kept mass per density on a fixed sample of ``grad + residual`` (all 1 without a
        sparse candidate: no decision reads it, so nothing is sampled). While a dense candidate runs
        the estimate is made again only for the periodic decision (the values the ranks hold, which
        they all hold alike, stand in between)."""
        if not any(c.sparse for c in self.candidates):
            return [1.0 for _ in self.densities]
        dense_now = self.active is not None and not self.candidates[self.active].sparse
        if dense_now and self.kept and self.since_decision < self.decide_every:
            # no residual to measure: the estimate stands until the periodic decision refreshes it
            return [self._kept_at(d) for d in self.densities]
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
        sq = x * x
        total = float(sq.sum())
        if not total > 0 or not math.isfinite(total):
            return [1.0 for _ in self.densities]
        m = sq.numel()
        ks = [min(m, max(1, math.ceil(d * m))) for d in self.densities]
        if res is None:  # no residual: a fresh gradient's kept mass overstates what error feedback will see
            return [kept_under_feedback(x, k) for k in ks]
        cs = sq.topk(max(ks), sorted=True).values.cumsum(0)  # only the largest share is ordered, not the sample
        return [float(cs[k - 1]) / total for k in ks]

    def _set_kept(self, kept: list[float]) -> None:
        """The kept mass the next decision uses. Under error feedback the accumulated vector spreads
        (its residual holds what was not sent), so a density keeps less of it than of a fresh gradient:
        while a dense candidate runs (no residual) the last measurement under a sparse one stands in,
        and before any, :func:`kept_under_feedback`'s estimate."""
        now = dict(zip(self.densities, kept))
        if self.active is not None and self.candidates[self.active].sparse:
            self.kept_ef = now
        self.kept = self.kept_ef if (self.kept_ef and self.active is not None
                                     and not self.candidates[self.active].sparse) else now

    def _kept_at(self, density: float) -> float:
        if density in self.kept:
            return self.kept[density]
        ds = sorted(self.kept)  # a candidate at another density: the nearest measured one below it
        below = [d for d in ds if d <= density]
        return self.kept[below[-1]] if below else (self.kept[ds[0]] if ds else 1.0)
