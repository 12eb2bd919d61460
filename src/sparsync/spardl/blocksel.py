"""Exact per-block top-k by magnitude, cheap on CPU, plus a deterministic top-k for shared data.

SparDL sends exactly ``kb`` entries per block (``spec/spardl.md`` §3, §4.3), so per-block selection
must be *exact* (the fixed message size depends on it) — but ``torch.topk`` over millions of
elements costs as much as a dense all-reduce at 1 Gbit/s on CPU (``DESIGN.md`` "Performance facts").

:func:`block_topk` selects the ``k`` largest ``|x|`` of every row of a 2-D view (rows = equal-size
blocks) with a sampled threshold and a correction:

1. ``a = |X|`` (one pass), a strided sample of ``s <= 65536`` elements per row, and its
   ``(1.15 f s + 3 sqrt(f s) + 8)``-th largest value ``t`` (``f = k/bs``) per row;
2. ``a >= t`` (one pass) and the flat ``nonzero`` of that mask (one pass over bytes);
3. rows with ``count >= k`` (the usual case): gather the candidates (``nonzero``), ``torch.topk`` over
   the small candidate matrix; rows with too few candidates fall back to a full ``torch.topk``.

The result is always the exact top-k set (up to ties at the k-th magnitude, which only one rank
ever decides in SRS); only the speed depends on the sample. :func:`topk_det` is the version used
where several ranks must pick identically from identical data (R-SAG/B-SAG top-L): ties at the
k-th magnitude are broken by the smaller index.
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_topk", "scratch_buffer", "topk_det"]

_SAMPLE = 65536
_MIN_ROW = 1 << 15  # below this a plain torch.topk is as cheap as the sampled path


def scratch_buffer(scratch: dict | None, key: str, numel: int, dtype, device) -> torch.Tensor:
    """A reusable 1-D buffer of at least ``numel`` elements from ``scratch`` (a dict the caller keeps).

    Fresh multi-MB tensors are page-faulted in on first touch: at n = 25.6M, ``x.abs()`` into a new
    tensor costs ~45 ms, into a reused one ~5 ms (measured here). Reusing buffers across steps
    removes most of the cost of the selection passes.
    """
    if scratch is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = scratch.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
        buf = scratch[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def block_topk(X: torch.Tensor, k: int, scratch: dict | None = None) -> torch.Tensor:
    """Column indices (int64, ``[m, k]``, unsorted) of the ``k`` largest ``|X[i]|`` in each row.

    ``scratch``: optional dict kept by the caller across calls; the ``|X|`` and mask buffers are
    reused from it (see :func:`scratch_buffer`).
    """
    m, bs = X.shape
    k = int(k)
    if k <= 0:
        return torch.empty(m, 0, dtype=torch.int64, device=X.device)
    if k >= bs:
        return torch.arange(bs, device=X.device).expand(m, bs).clone()
    a = torch.abs(X, out=scratch_buffer(scratch, "abs", m * bs, X.dtype, X.device).view(m, bs))
    if bs < _MIN_ROW or 4 * k > bs:
        return torch.topk(a, k, dim=1, sorted=False).indices
    stride = max(1, bs // _SAMPLE)
    sample = a[:, ::stride]
    s = sample.shape[1]
    f = k / bs
    kk = min(s, math.ceil(1.15 * f * s + 3.0 * math.sqrt(f * s) + 8))
    t = torch.kthvalue(sample, s - kk + 1, dim=1).values  # kk-th largest of the sample
    mask = torch.ge(a, t[:, None], out=scratch_buffer(scratch, "mask", m * bs, torch.bool, X.device).view(m, bs))
    flat = mask.view(-1).nonzero().flatten()  # one compare pass + one nonzero pass
    rows = torch.div(flat, bs, rounding_mode="floor")
    counts = torch.bincount(rows, minlength=m)
    ok = counts >= k
    if not bool(ok.all()):  # sample was unlucky for some rows: exact fallback there
        out = torch.topk(a, k, dim=1, sorted=False).indices if m == 1 else None
        if out is None:
            out = torch.empty(m, k, dtype=torch.int64, device=X.device)
            bad = (~ok).nonzero().flatten()
            out[bad] = torch.topk(a[bad], k, dim=1, sorted=False).indices
            good = ok.nonzero().flatten()
            if good.numel():
                sel = ok[rows]
                grows = rows[sel]
                remap = torch.cumsum(ok.long(), 0) - 1
                out[good] = _from_flat(a[good], remap[grows], flat[sel] - grows * bs, counts[good], k)
        return out
    return _from_flat(a, rows, flat - rows * bs, counts, k)


def _from_flat(a, rows, cols, counts, k):
    """Top-k of every row among the candidates (rows, cols) (row-major order, >= k per row)."""
    m = a.shape[0]
    cmax = int(counts.max())
    offs = torch.cumsum(counts, 0) - counts
    pos = torch.arange(rows.numel(), device=a.device) - offs[rows]
    cand = torch.full((m, cmax), -1.0, dtype=a.dtype, device=a.device)
    cand[rows, pos] = a[rows, cols]
    ccol = torch.zeros((m, cmax), dtype=torch.int64, device=a.device)
    ccol[rows, pos] = cols
    j = torch.topk(cand, k, dim=1, sorted=False).indices
    return ccol.gather(1, j)


def topk_det(idx: torch.Tensor, vals: torch.Tensor, k: int):
    """Top-``k`` entries of a coalesced sparse list (``idx`` ascending) by ``|vals|``, ties -> smaller index.

    Returns ``(keep_idx, keep_vals, drop_idx, drop_vals)``; kept entries sorted by index. A stable
    sort on ``-|v|`` keeps equal magnitudes in index order, so identical inputs give identical
    choices on every rank.
    """
    n = idx.numel()
    if k >= n:
        e = idx[:0]
        return idx, vals, e, vals[:0]
    order = torch.sort(-vals.abs(), stable=True).indices
    keep = torch.sort(order[:k]).values
    drop = torch.sort(order[k:]).values
    return idx[keep], vals[keep], idx[drop], vals[drop]
