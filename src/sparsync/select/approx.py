"""SparCML's selection kernels: bucketed top-k and approximate top-k "in expectation" (§7.2-7.3).

All return ``(indices, values)`` with indices sorted ascending (int64) and ``values = x[indices]``;
all are vectorised torch ops, device agnostic. Randomised kernels take a ``torch.Generator`` (or a
``seed``); ranks that must make the same choice use the same seed, ranks that select independently
(the ``sparcml`` reducer) use different ones.

* :func:`bucketed_topk` — exact top-``kb`` inside every bucket of ``bucket_size`` (512 in the
  thesis' CNTK integration) elements: one ``topk`` on a ``(n_buckets, bucket_size)`` view, so each
  bucket has a fixed slot of ``kb`` entries (the ragged last bucket gets ``min(kb, its length)``).
* :func:`approx_topk_probs` — probabilities of Theorem 2.1 (``spec/sparcml.md`` §7.2)::

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

__all__ = [
    "approx_topk",
    "approx_topk_at_most",
    "approx_topk_probs",
    "at_most_probs",
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


def bucketed_topk(x: torch.Tensor, kb: int, bucket_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``kb`` by magnitude inside every bucket of ``bucket_size`` elements (fixed slots)."""
    kb = _check(x, kb, "bucketed_topk")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    n = x.numel()
    kb = min(kb, bucket_size)
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
