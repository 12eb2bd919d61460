"""Synthetic sparse inputs for collective benchmarks and tests.

Why: sparse all-reduce algorithms behave very differently depending on how much the ranks'
supports overlap (SparCML thesis §3.2: the size of the result is between ``k`` and
``P*k``). Three patterns span that range:

- ``"random"``: every rank picks ``k = round(density * numel)`` distinct indices uniformly at
  random, seeded by ``(seed, rank)`` -> expected union ``numel * (1 - (1 - d)^P)``.
- ``"identical"``: the same ``k`` indices on every rank (seeded by ``seed`` only), values differ
  per rank -> union exactly ``k`` (best case for sparse).
- ``"disjoint"``: rank ``r`` owns indices ``slot * P + r`` for ``k`` random slots in
  ``[0, numel // P)`` -> supports are pairwise disjoint and the union is exactly ``P*k``
  (worst case). Requires ``P*k <= numel``.

A fourth pattern is the **reducer benchmark's workload** (``sparsync bench reducers --pattern
heavy_tail``, ``docs/benchmarks.md``), a *gradient* rather than a support pattern:

- ``"heavy_tail"``: rank ``r``'s ``j``-th gradient is
  ``g_{r,j} = randn(n, seed 1000+17r+j) * exp(1.5 * randn(n, seed 12345)) * 1e-3`` (fp32) - a
  heavy-tailed per-element scale shared by all ranks, so the ranks' top-k sets overlap partly (the
  union of four top-1% sets is ~2.3% of ``n``). Two gradients per rank (``j = 0, 1``) alternate call
  by call (:func:`heavy_tail_grads`). As a sparse input (:func:`make_sparse`, lossless collectives)
  it is the exact top-k of ``|g_{r,j}|`` (indices precomputed, as the plain all-gather reference does);
  ``variant`` picks ``j``. ``seed`` is ignored: the seeds are part of the workload's definition.

``k`` follows the shared rule ``k = max(1, round(density * numel))`` (``select/topk.py``).
Values are standard normal with zeros replaced by 1.0, so every stored value is nonzero.
Everything is vectorised; the only loop is the (rarely repeated) rejection step of the sampler.
"""

from __future__ import annotations

import torch

from ..select.topk import k_for_density
from ..sparse import SparseVec

__all__ = ["ALTERNATING", "GRAD_PATTERNS", "PATTERNS", "heavy_tail_grad", "heavy_tail_grads", "make_sparse",
           "sample_distinct"]

PATTERNS = ("random", "identical", "disjoint", "heavy_tail")
#: patterns whose inputs alternate call by call between two variants (``j = 0, 1``)
ALTERNATING = ("heavy_tail",)
#: dense gradient sources of ``sparsync bench reducers``: "normal" (standard normal per (seed, rank,
#: step), :func:`sparsync.bench.reducers.make_grad`) and the issue-11 workload
GRAD_PATTERNS = ("normal", "heavy_tail")

HEAVY_SCALE_SEED = 12345  # the shared per-element scale
HEAVY_BASE_SEED, HEAVY_RANK_STRIDE = 1000, 17  # g_{r,j} seeded by 1000 + 17 r + j
HEAVY_SIGMA, HEAVY_AMPLITUDE = 1.5, 1e-3

_RANK_MUL = 1_000_003
_INDEX_STREAM = 7_919  # offsets separating the index and value streams of one (seed, rank)
_VALUE_STREAM = 104_729


def _gen(seed: int, rank: int, stream: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((int(seed) * _RANK_MUL + int(rank)) * 131 + stream & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def sample_distinct(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` distinct integers drawn uniformly from ``[0, n)``, sorted ascending (int64).

    Dense-ish case (k > n/8): ``randperm``. Sparse case: oversample with ``randint``, deduplicate,
    then keep a uniformly random size-``k`` subset of the distinct values (uniform over k-subsets
    by exchangeability); repeats the draw in the unlikely event of too few distinct values.
    """
    n, k = int(n), int(k)
    if not 0 <= k <= n:
        raise ValueError(f"cannot draw {k} distinct values from [0, {n})")
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if k * 8 > n:
        return torch.sort(torch.randperm(n, generator=gen)[:k]).values
    draw = k + k // 4 + 16
    while True:
        cand = torch.unique(torch.randint(0, n, (draw,), generator=gen, dtype=torch.int64))
        if cand.numel() >= k:
            keep = torch.randperm(cand.numel(), generator=gen)[:k]
            return torch.sort(cand[keep]).values
        draw *= 2


def _seeded_randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(int(n), generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float32)


def heavy_tail_grad(rank: int, j: int, numel: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``g_{r,j} = randn(n, seed 1000+17r+j) * exp(1.5 * randn(n, seed 12345)) * 1e-3`` (fp32, CPU).

    ``scale``: the shared factor ``exp(1.5 * randn(n, seed 12345))`` when the caller already has it
    (it is the same for every rank and ``j``).
    """
    if scale is None:
        scale = torch.exp(HEAVY_SIGMA * _seeded_randn(numel, HEAVY_SCALE_SEED))
    g = _seeded_randn(numel, HEAVY_BASE_SEED + HEAVY_RANK_STRIDE * int(rank) + int(j))
    return g.mul_(scale).mul_(HEAVY_AMPLITUDE)


def heavy_tail_grads(rank: int, numel: int) -> list[torch.Tensor]:
    """Rank ``rank``'s two gradients ``[g_{r,0}, g_{r,1}]``, to be alternated call by call."""
    scale = torch.exp(HEAVY_SIGMA * _seeded_randn(numel, HEAVY_SCALE_SEED))
    return [heavy_tail_grad(rank, j, numel, scale) for j in (0, 1)]


def _top_k(g: torch.Tensor, k: int) -> SparseVec:
    idx = torch.sort(torch.topk(g.abs(), k, sorted=False).indices).values
    vals = g[idx]
    return SparseVec(idx, torch.where(vals == 0, torch.ones_like(vals), vals), g.numel(), check=False)


def _values(k: int, seed: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    v = torch.randn(k, generator=_gen(seed, rank, _VALUE_STREAM), dtype=torch.float64)
    v = torch.where(v == 0, torch.ones_like(v), v).to(dtype)
    # a value can underflow to 0 in low precision dtypes; keep every stored value nonzero
    return torch.where(v == 0, torch.ones_like(v), v)


def make_sparse(
    pattern: str,
    rank: int,
    world_size: int,
    numel: int,
    density: float,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    variant: int = 0,
) -> SparseVec:
    """Rank ``rank``'s input SparseVec for ``pattern`` (see module docstring).

    Deterministic in ``(pattern, rank, world_size, numel, density, seed, variant)``: call it on every
    rank (or for every rank in one process to build the dense reference sum). ``variant`` is the
    ``j`` of the alternating patterns (:data:`ALTERNATING`) and ignored by the others.
    """
    numel = int(numel)
    world_size = int(world_size)
    rank = int(rank)
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    k = k_for_density(numel, density)
    if pattern == "random":
        idx = sample_distinct(numel, k, _gen(seed, rank, _INDEX_STREAM))
    elif pattern == "identical":
        idx = sample_distinct(numel, k, _gen(seed, -1, _INDEX_STREAM))
    elif pattern == "disjoint":
        if world_size * k > numel:
            raise ValueError(
                f"pattern 'disjoint' needs world_size * k <= numel, got {world_size} * {k} > {numel} "
                f"(k = round(density * numel) with density={density}); lower the density or world size"
            )
        slots = sample_distinct(numel // world_size, k, _gen(seed, rank, _INDEX_STREAM))
        idx = slots * world_size + rank
    elif pattern == "heavy_tail":
        return _top_k(heavy_tail_grad(rank, variant, numel).to(dtype), k)
    else:
        raise ValueError(f"unknown pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
    return SparseVec(idx, _values(k, seed, rank, dtype), numel, check=False)
