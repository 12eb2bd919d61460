"""SparCML's selection kernels: bucketed top-k and approximate top-k "in expectation" (thesis §2.4.1, §4.3).

All return ``(indices, values)`` with indices sorted ascending (int64) and ``values = x[indices]``;
all are vectorised torch ops, device agnostic. Randomised kernels take a ``torch.Generator`` (or a
``seed``); ranks that must make the same choice use the same seed, ranks that select independently
(the ``sparcml`` reducer) use different ones.

* :func:`bucketed_sample` — the thesis' bucketed kernel (§4.3): inside every
  bucket of ``bucket_size`` (512 in the CNTK integration) elements, keep each entry independently
  with the L1/L-inf probabilities below computed *per bucket* for ``kb`` expected selections, then
  pad (zero-valued pairs) or truncate (the first ``kb`` in index order, as the GPU kernel's prefix-sum
  write offsets do) to exactly ``kb`` pairs per bucket. Vectorised over a ``(n_buckets, bucket_size)``
  view; a ``real`` mask tells the selected pairs from the padding.
* :func:`bucketed_topk` — exact top-``kb`` inside every bucket: one ``topk`` on the same view, so each
  bucket has a fixed slot of ``kb`` entries (the ragged last bucket gets ``min(kb, its length)``).
  Deterministic and keeps each bucket's largest entries (our earlier kernel, kept as an option).
* :func:`approx_topk_probs` — probabilities of Theorem 2.1 (§2.4.1)::

      p_i = k |v_i| / ||v||_1                         if ||v||_inf <= ||v||_1 / k
      p_i = k (|v_i| + eps) / (||v||_1 + N eps)       otherwise, eps = (k ||v||_inf - ||v||_1)/(N - k)

  (``eps`` at its lower bound, our implementation choice), so ``sum p = k`` and ``0 <= p <= 1``.
  Degenerate cases: ``k >= N`` -> all ones; ``||v||_1 = 0`` -> uniform ``k/N``.
* :func:`approx_topk` — keep index ``i`` independently with probability ``p_i``: ``E[#] = k``,
  ``Var[#] = sum p_i (1 - p_i)``.
* :func:`approx_topk_at_most` — the cheaper variant ``p_i = min(1, k |v_i| / ||v||_1)`` (no L-inf):
  at most ``k`` selected in expectation.
"""

from __future__ import annotations

import torch

from .topk import topk_abs

#: Guards the fp64 divisions by ``l1`` against 0 (an all-zero bucket); such buckets are replaced by
#: the uniform ``k / m`` right after, so the value only has to be positive and far below any real ``l1``.
_TINY = 1e-300

__all__ = [
    "approx_topk",
    "approx_topk_at_most",
    "approx_topk_probs",
    "at_most_probs",
    "bucketed_sample",
    "bucketed_topk",
    "make_generator",
    "topk_abs",
]


def _check(x: torch.Tensor, k: int, what: str) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        raise ValueError(f"{what} needs a 1-D tensor")
    k = int(k)
    if k < 0:
        raise ValueError(f"{what}: k must be >= 0, got {k}")
    return k


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) if seed is not None else 0)
    return g


def _bucket_args(x: torch.Tensor, kb: int, bucket_size: int, name: str) -> tuple[int, int]:
    """Checked ``(kb, n)`` of a bucketed selection: ``kb`` capped at the bucket size."""
    kb = _check(x, kb, name)
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    return min(kb, bucket_size), x.numel()


def bucketed_topk(x: torch.Tensor, kb: int, bucket_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``kb`` by magnitude inside every bucket of ``bucket_size`` elements (fixed slots)."""
    kb, n = _bucket_args(x, kb, bucket_size, "bucketed_topk")
    if kb == 0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device), x.new_empty(0)
    nb = -(-n // bucket_size)
    pad = nb * bucket_size - n
    a = x.abs()
    if pad:
        # padding gets -1 so it is never chosen over a real entry (|x| >= 0)
        a = torch.cat([a, a.new_full((pad,), -1.0)])
    _, pos = torch.topk(a.view(nb, bucket_size), kb, dim=1, sorted=False)
    pos, _ = torch.sort(pos, dim=1)
    idx = (pos + torch.arange(nb, device=x.device).unsqueeze(1) * bucket_size).reshape(-1)
    if pad:
        idx = idx[idx < n]
    return idx, x[idx]


def _bucket_view(x: torch.Tensor, bucket_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|x|`` as ``(n_buckets, bucket_size)`` zero-padded, per-bucket lengths)."""
    n = x.numel()
    nb = -(-n // bucket_size)
    a = torch.zeros(nb * bucket_size, dtype=x.dtype, device=x.device)
    a[:n] = x.abs()
    lengths = torch.full((nb,), bucket_size, dtype=torch.int64, device=x.device)
    lengths[-1] = n - (nb - 1) * bucket_size
    return a.view(nb, bucket_size), lengths


def bucket_probs(x: torch.Tensor, kb: int, bucket_size: int = 512) -> torch.Tensor:
    """Per-bucket L1/L-inf probabilities ``(n_buckets, bucket_size)`` (0 on the padding of the last one).

    Bucket ``b`` of length ``m`` gets :func:`approx_topk_probs` of its entries with ``k = min(kb, m)``:
    ``sum = min(kb, m)``, ``0 <= p <= 1``; an all-zero bucket gets the uniform ``k/m``."""
    a, m = _bucket_view(x, bucket_size)
    a = a.double()
    k = torch.clamp(m, max=kb).double().unsqueeze(1)
    mm = m.double().unsqueeze(1)
    valid = torch.arange(bucket_size, device=x.device).unsqueeze(0) < m.unsqueeze(1)
    l1 = a.sum(1, keepdim=True)
    linf = a.amax(1, keepdim=True)
    eps = torch.where(mm > k, (k * linf - l1) / (mm - k).clamp(min=1), torch.zeros_like(l1)).clamp(min=0)
    p = torch.where(linf * k <= l1, a * k / l1.clamp(min=_TINY), (a + eps) * k / (l1 + mm * eps).clamp(min=_TINY))
    p = torch.where(l1 == 0, k / mm, p)
    p = torch.where(k >= mm, torch.ones_like(p), p)
    return torch.where(valid, p.clamp(0.0, 1.0), torch.zeros_like(p))


def bucketed_sample(x: torch.Tensor, kb: int, bucket_size: int = 512, generator: torch.Generator | None = None,
                    seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thesis' bucketed selection: sample by :func:`bucket_probs`, then pad/truncate to ``kb`` per bucket.

    Returns ``(indices, values, real)``: exactly ``min(kb, length)`` pairs per bucket, indices sorted;
    ``real`` marks sampled pairs (``values = x[indices]``); padding pairs sit at unsampled positions of
    their bucket with value 0 (so a sum is unchanged, and error feedback must keep ``x`` there).
    """
    kb, n = _bucket_args(x, kb, bucket_size, "bucketed_sample")
    if kb == 0 or n == 0:
        e = torch.empty(0, dtype=torch.int64, device=x.device)
        return e, x.new_empty(0), torch.empty(0, dtype=torch.bool, device=x.device)
    if generator is None:
        generator = make_generator(seed, x.device)
    p = bucket_probs(x, kb, bucket_size)
    nb = p.shape[0]
    sel = torch.rand(p.shape, generator=generator, dtype=p.dtype, device=x.device) < p
    pos = torch.arange(bucket_size, device=x.device).expand(nb, bucket_size)
    # sampled entries first (in index order: truncation keeps the first kb), then the padding slots
    order = torch.sort(torch.where(sel, pos, pos + bucket_size), dim=1).indices[:, :kb]
    real = sel.gather(1, order)
    idx = (order + torch.arange(nb, device=x.device).unsqueeze(1) * bucket_size).reshape(-1)
    real = real.reshape(-1)
    keep = idx < n  # a short last bucket has fewer slots
    idx, real = idx[keep], real[keep]
    idx, perm = torch.sort(idx)
    real = real[perm]
    vals = torch.where(real, x[idx], torch.zeros((), dtype=x.dtype, device=x.device))
    return idx, vals, real


def approx_topk_probs(x: torch.Tensor, k: int) -> torch.Tensor:
    """Selection probabilities with ``sum == k`` and ``0 <= p <= 1`` (module docstring)."""
    k = _check(x, k, "approx_topk_probs")
    n = x.numel()
    if k >= n:
        return torch.ones_like(x)
    a = x.abs()
    l1 = float(a.double().sum())
    if k == 0:
        return torch.zeros_like(x)
    if l1 == 0.0:
        return torch.full_like(x, k / n)
    linf = float(a.max())
    if linf <= l1 / k:
        p = a * (k / l1)
    else:
        eps = (k * linf - l1) / (n - k)
        p = (a + eps) * (k / (l1 + n * eps))
    return p.clamp_(0.0, 1.0)


def at_most_probs(x: torch.Tensor, k: int) -> torch.Tensor:
    """``min(1, k |v_i| / ||v||_1)`` (all zero when ``||v||_1 = 0``)."""
    k = _check(x, k, "approx_topk_at_most")
    a = x.abs()
    l1 = float(a.double().sum())
    if l1 == 0.0 or k == 0:
        return torch.zeros_like(x)
    return (a * (k / l1)).clamp_(max=1.0)


def _sample(x, p, generator):
    u = torch.rand(x.numel(), generator=generator, dtype=p.dtype, device=x.device)
    idx = torch.nonzero(u < p, as_tuple=True)[0]
    return idx, x[idx]


def approx_topk(x: torch.Tensor, k: int, generator: torch.Generator | None = None,
                seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each index independently with :func:`approx_topk_probs` (expected count exactly ``k``)."""
    if generator is None:
        generator = make_generator(seed, x.device)
    return _sample(x, approx_topk_probs(x, k), generator)


def approx_topk_at_most(x: torch.Tensor, k: int, generator: torch.Generator | None = None,
                        seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each index independently with :func:`at_most_probs` (expected count at most ``k``)."""
    if generator is None:
        generator = make_generator(seed, x.device)
    return _sample(x, at_most_probs(x, k), generator)
