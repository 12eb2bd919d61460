"""Exact per-block top-k by magnitude for SparDL, plus a deterministic top-k for shared data.

SparDL sends exactly ``kb`` entries per block (SparDL paper §3-4), so per-block selection
must be *exact* (the fixed message size depends on it) — but ``torch.topk`` over millions of
elements can cost as much as the dense all-reduce it is meant to replace.

:func:`block_topk` selects the ``k`` largest ``|x|`` of every row of a 2-D view (rows = equal-size
blocks) with the exact kernel of :mod:`sparsync.select.exact` (sampled bracket, one compaction pass
over all rows at once, exact select among the candidates; ties -> lowest column). :func:`topk_det`
is the version for coalesced sparse lists where several ranks must pick identically from identical
data (R-SAG/B-SAG top-L, gTop-k merges): ties at the k-th magnitude go to the smaller index.
"""

from __future__ import annotations

import torch

from ..select.exact import scratch_buffer, topk_indices, topk_rows

__all__ = ["block_topk", "scratch_buffer", "topk_det"]


def block_topk(X: torch.Tensor, k: int, scratch: dict | None = None) -> torch.Tensor:
    """Column indices (int64, ``[m, k]``, ascending in every row) of the ``k`` largest ``|X[i]|`` per row.

    All rows at once (:func:`sparsync.select.exact.topk_rows`: one pass over ``X``, no loop over
    rows); ties at a row's k-th magnitude go to the lowest columns. ``scratch``: optional dict kept
    by the caller across calls (the tile workspace is reused from it).
    """
    return topk_rows(X, k, scratch)


def topk_det(idx: torch.Tensor, vals: torch.Tensor, k: int):
    """Top-``k`` entries of a coalesced sparse list (``idx`` ascending) by ``|vals|``, ties -> smaller index.

    Returns ``(keep_idx, keep_vals, drop_idx, drop_vals)``, both sorted by index. The exact kernel's
    tie rule (lowest position wins) is "smaller index wins" here, so identical inputs give identical
    choices on every rank.
    """
    n = idx.numel()
    if k >= n:
        e = idx[:0]
        return idx, vals, e, vals[:0]
    mask = torch.zeros(n, dtype=torch.bool, device=vals.device)
    mask[topk_indices(vals, k)] = True  # positions ascending = indices ascending: ties -> smaller index
    return idx[mask], vals[mask], idx[~mask], vals[~mask]
