"""Kept mass and the convergence cost of low density, for the ``auto`` reducer
(:mod:`sparsync.reducers.auto`).

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

#: convergence cost coefficient c in ``1 + c (1 - kept) / kept``, calibrated from steps to target of
#: error-feedback MiCRO on the digits MLP (4 workers, Nesterov SGD: dense 36 steps, MiCRO 1 / 2 / 5 %
#: 49.5 / 48 / 40 at kept mass 0.185 / 0.255 / 0.406, so c = 0.085 / 0.114 / 0.076)
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
    """The kept mass per density that auto's decisions use (``kept``, the same on every rank once
    :meth:`update` got the mean over ranks). :meth:`local` measures this rank's on a fixed sample of
    ``grad + residual``; while a dense candidate runs (no residual) the last value measured under a
    sparse one stands in (``under_ef``), and before any, :func:`kept_under_feedback`'s estimate."""

    def __init__(self, densities, sample: int):
        self.densities, self.sample = tuple(densities), sample
        self.kept: dict[float, float] = {}
        self.under_ef: dict[float, float] = {}
        self._idx: torch.Tensor | None = None

    def local(self, grad: torch.Tensor, residual: torch.Tensor | None, measure: bool = True) -> list[float]:
        """This rank's kept mass per density. ``measure=False``: the values held stand (no sample)."""
        if not measure and self.kept:
            return [self.at(d) for d in self.densities]
        n = grad.numel()
        if self._idx is None or self._idx.numel() and int(self._idx[-1]) >= n:
            g = torch.Generator().manual_seed(12345)  # the same positions on every rank and every call
            self._idx = (torch.randint(0, n, (self.sample,), generator=g).unique() if self.sample < n
                         else torch.arange(n))
        idx = self._idx.to(grad.device)
        x = grad.index_select(0, idx).double()
        if residual is not None:
            x = x + residual.index_select(0, idx).double()
        sq = x * x
        total = float(sq.sum())
        if not total > 0 or not math.isfinite(total):
            return [1.0 for _ in self.densities]
        ks = [min(sq.numel(), max(1, math.ceil(d * sq.numel()))) for d in self.densities]
        if residual is None:  # a fresh gradient's kept mass overstates what error feedback will see
            return [kept_under_feedback(x, k) for k in ks]
        cs = sq.topk(max(ks), sorted=True).values.cumsum(0)
        return [float(cs[k - 1]) / total for k in ks]

    def update(self, kept: list[float], sparse_running: bool | None) -> None:
        """The mean over ranks of :meth:`local` becomes what decisions use (``sparse_running``: whether
        a sparse candidate made it; None before any candidate ran)."""
        now = dict(zip(self.densities, kept))
        if sparse_running:
            self.under_ef = now
        self.kept = self.under_ef if (self.under_ef and sparse_running is False) else now

    def at(self, density: float) -> float:
        """The kept mass at ``density``: measured, else the nearest measured density below it."""
        if density in self.kept:
            return self.kept[density]
        ds = sorted(self.kept)
        below = [d for d in ds if d <= density]
        return self.kept[below[-1]] if below else (self.kept[ds[0]] if ds else 1.0)
