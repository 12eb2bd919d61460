"""Exact top-k by magnitude (the kernel of :mod:`.exact`), and the density -> k rule shared by every reducer."""

from __future__ import annotations

import math

import torch

from .exact import topk_select


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


def topk_abs(x: torch.Tensor, k: int, scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of largest ``|x|``: (indices sorted ascending, values ``x[indices]``).

    Cost: about one read of ``x`` (:func:`sparsync.select.exact.topk_indices`). Ties at the k-th
    magnitude go to the lowest indices, so identical ``x`` gives identical selections on every rank.
    ``scratch``: optional dict kept by the caller across calls (workspace reuse).
    """
    if x.dim() != 1:
        raise ValueError(f"topk_abs needs a 1-D tensor, got shape {tuple(x.shape)}")
    return topk_select(x, k, scratch)
