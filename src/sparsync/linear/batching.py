"""The global-batch schedule shared by every trainer (thesis Algorithm 1 with a fixed *global* batch):
each epoch one permutation seeded by (seed, epoch), cut into global batches, and worker ``r`` of ``P``
takes the contiguous slice ``[r b/P, (r+1) b/P)`` of each. Nothing depends on ``P`` but the slice, so
every worker count (and every aggregation strategy) walks the same samples in the same steps."""

from __future__ import annotations

import torch

__all__ = ["batches", "worker_slice"]


def worker_slice(n: int, r: int, P: int) -> tuple[int, int]:
    """Worker ``r``'s ``[lo, hi)`` of ``n`` items split into ``P`` contiguous near-equal slices."""
    return r * n // P, (r + 1) * n // P


def batches(n: int, global_batch: int, seed: int, epoch: int):
    """The epoch's global batches: a permutation of ``range(n)`` cut into ``global_batch`` pieces."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) * 7919 + epoch))
    return perm.split(global_batch)
