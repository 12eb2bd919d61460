"""Synthetic sparse inputs for collective benchmarks and tests.

Why: sparse all-reduce algorithms behave very differently depending on how much the ranks'
supports overlap (SparCML ``spec/sparcml.md``: the size of the result is between ``k`` and
``P*k``). Three patterns span that range:

- ``"random"``: every rank picks ``k = round(density * numel)`` distinct indices uniformly at
  random, seeded by ``(seed, rank)`` -> expected union ``numel * (1 - (1 - d)^P)``.
- ``"identical"``: the same ``k`` indices on every rank (seeded by ``seed`` only), values differ
  per rank -> union exactly ``k`` (best case for sparse).
- ``"disjoint"``: rank ``r`` owns indices ``slot * P + r`` for ``k`` random slots in
  ``[0, numel // P)`` -> supports are pairwise disjoint and the union is exactly ``P*k``
  (worst case). Requires ``P*k <= numel``.

``k`` follows the shared rule ``k = max(1, round(density * numel))`` (``select/topk.py``).
Values are standard normal with zeros replaced by 1.0, so every stored value is nonzero.
Everything is vectorised; the only loop is the (rarely repeated) rejection step of the sampler.
"""

from __future__ import annotations

import torch

from ..select.topk import k_for_density
from ..sparse import SparseVec

__all__ = ["PATTERNS", "make_sparse", "sample_distinct"]

PATTERNS = ("random", "identical", "disjoint")

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
) -> SparseVec:
    """Rank ``rank``'s input SparseVec for ``pattern`` (see module docstring).

    Deterministic in ``(pattern, rank, world_size, numel, density, seed)``: call it on every rank
    (or for every rank in one process to build the dense reference sum).
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
    else:
        raise ValueError(f"unknown pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
    return SparseVec(idx, _values(k, seed, rank, dtype), numel, check=False)
