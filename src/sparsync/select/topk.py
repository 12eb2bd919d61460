"""Exact top-k by magnitude, and the density -> k rule shared by every reducer."""

from __future__ import annotations

import math

import torch


def check_density(density: float) -> float:
    """Density must be a number in (0, 1]."""
    try:
        d = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}") from None
    if not (0.0 < d <= 1.0) or math.isnan(d):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return d


def k_for_density(numel: int, density: float) -> int:
    """``k = max(1, round(density * numel))`` (never more than ``numel``)."""
    return min(numel, max(1, int(round(check_density(density) * numel))))


def topk_abs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of largest ``|x|``: (indices sorted ascending, values ``x[indices]``).

    Cost: one ``torch.topk`` over ``|x|`` (O(n) passes, the expensive part on CPU) + sort of k.
    Ties at the k-th magnitude are broken by torch.topk; callers that need the same selection on
    several ranks must pass identical ``x`` (then the result is identical too).
    """
    if x.dim() != 1:
        raise ValueError(f"topk_abs needs a 1-D tensor, got shape {tuple(x.shape)}")
    k = int(k)
    if not 0 <= k <= x.numel():
        raise ValueError(f"k must be in [0, {x.numel()}], got {k}")
    if k == x.numel():
        idx = torch.arange(x.numel(), device=x.device)
        return idx, x.clone()
    _, idx = torch.topk(x.abs(), k, sorted=False)
    idx, _ = torch.sort(idx)
    return idx, x[idx]
