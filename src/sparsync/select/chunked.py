"""Chunked top-k: the ``k`` largest magnitudes of every chunk of ``chunk`` consecutive entries.

SparseLoCo (Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706,
2025) cuts each tensor into chunks of 64 x 64 = 4096 entries and sends the top 64 of each (1.56 %):
every chunk sends the same count, so the wire needs no counts, a chunk-local index fits in
``log2(chunk)`` bits (12 for 4096), and selection is one batched pass instead of a global top-k.

Contract of :func:`chunked_topk`: for ``x`` of ``n`` entries, the full chunks ``[c*chunk, (c+1)*chunk)``
each give exactly ``k`` indices; a last, short chunk of ``r`` entries gives :func:`short_chunk_k`
``= max(1, round(k * r / chunk))`` (at most ``r``) - its proportional share. Within a chunk the
entries of largest ``|x|`` win, and among equal magnitudes the lower index (the house's tie rule, so
every rank that holds the same values selects the same entries). Indices come back global, sorted,
int64. With the C kernels (:func:`sparsync.native.chunked_topk`, a fp32 CPU tensor): a radix select on
the magnitudes' bits per chunk, about one read of ``x`` and 5x faster than the torch form; otherwise
``|x|``, one ``topk`` over the magnitudes (batched per chunk) for the k-th magnitude, one comparison
pass with a per-chunk count, the ``nonzero`` compaction, and a prefix count over the columns only in
the chunks with surplus ties at the k-th magnitude. Both give the same indices (tested side by side).
"""

from __future__ import annotations

import torch

from .. import native

__all__ = ["chunked_topk", "short_chunk_k", "per_chunk_k"]


def short_chunk_k(k: int, chunk: int, rest: int) -> int:
    """Entries a last chunk of ``rest`` entries sends: its share of ``k``, at least 1, at most ``rest``."""
    return min(rest, max(1, round(k * rest / chunk)))


def per_chunk_k(density: float, chunk: int) -> int:
    """``k`` per full chunk for a density: ``round(density * chunk)``; a one-line error below 1."""
    k = int(round(float(density) * int(chunk)))
    if k < 1:
        raise ValueError(f"density {density:g} x chunk {chunk} = {density * chunk:.3g} entries per chunk: "
                         "at least one must be sent (raise the density or the chunk)")
    return min(k, int(chunk))


def _rows_topk(a: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask ``[rows, width]``: the ``k`` largest of every row of ``a`` (ties: the lower column).

    ``a >= kth`` holds at least ``k`` entries per row, exactly ``k`` unless entries tie at the k-th
    magnitude; only the rows with surplus ties (an all-zero chunk, repeated values) are resolved, by a
    prefix count over their tied columns, so continuous data pays no width-sized count pass."""
    if k >= a.shape[1]:
        return torch.ones_like(a, dtype=torch.bool)
    kth = torch.topk(a, k, dim=1, sorted=False).values.min(dim=1, keepdim=True).values
    mask = a >= kth
    rows = torch.nonzero(mask.sum(dim=1) > k).squeeze(1)
    if rows.numel():
        sub, t = a.index_select(0, rows), kth.index_select(0, rows)
        above, tied = sub > t, sub == t
        need = k - above.sum(dim=1, keepdim=True)  # ties to take, by ascending column
        mask[rows] = above | (tied & (torch.cumsum(tied, dim=1, dtype=torch.int32) <= need))
    return mask


def chunked_topk(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Global sorted int64 indices of the per-chunk top-``k`` of ``|x|`` (module docstring)."""
    n = x.numel()
    full, rest = divmod(n, chunk)
    flat = x.detach().reshape(-1)
    if n and native.usable(flat):
        return native.chunked_topk(flat, chunk, k, short_chunk_k(k, chunk, rest) if rest else 0)
    a = flat.abs()
    parts = []
    if full:
        mask = _rows_topk(a[: full * chunk].view(full, chunk), k)
        parts.append(torch.nonzero(mask.reshape(-1)).squeeze(1))
    if rest:
        last = _rows_topk(a[full * chunk:].view(1, rest), short_chunk_k(k, chunk, rest))
        parts.append(torch.nonzero(last.reshape(-1)).squeeze(1) + full * chunk)
    return torch.cat(parts) if len(parts) > 1 else parts[0]
