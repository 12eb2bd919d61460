"""Spar-Reduce-Scatter bag and peer arithmetic for any group size (SparDL paper §4).

For team-local rank ``r`` in a group of ``q`` members, ``l = ceil(log2 q)`` and ``E = q - 2^(l-1)``:
``B[0] = {r}`` (preservation bag), ``B[j] = {r + 2^(j-1), ..., r + 2^j - 1}`` for ``j < l`` and the
last bag ``B[l]`` holds the ``E`` remaining blocks (all mod ``q``). At step ``i = 1..l`` worker ``r``
sends bag ``B[l-i+1]`` to ``(r + 2^(l-i)) mod q`` and receives the same-numbered bag of
``(r - 2^(l-i)) mod q``, whose blocks are ``r, r+1, ..., r+|bag|-1`` (mod q) — a subset of the blocks
``r`` still holds (the paper's Theorem 1).

Bags are always runs of consecutive blocks modulo ``q``; :func:`runs` splits a bag into at most two
contiguous slices so selection can work on views of the ``[q, bs]`` block matrix without copies.
"""

from __future__ import annotations

__all__ = ["bags", "last_bag_size", "num_steps", "runs", "schedule"]


def num_steps(q: int) -> int:
    """``l = ceil(log2 q)`` (0 for q = 1)."""
    if q < 1:
        raise ValueError(f"group size must be >= 1, got {q}")
    return (q - 1).bit_length()


def last_bag_size(q: int) -> int:
    """``E = q - 2^(l-1)`` (0 for q = 1)."""
    l = num_steps(q)
    return 0 if l == 0 else q - 2 ** (l - 1)


def bags(q: int, r: int) -> list[list[int]]:
    """``[B0, B1, ..., Bl]`` of rank ``r`` (block numbers mod ``q``)."""
    l = num_steps(q)
    E = last_bag_size(q)
    out = [[r % q]]
    start = r + 1
    for j in range(1, l + 1):
        size = 2 ** (j - 1) if j < l else E
        out.append([(start + x) % q for x in range(size)])
        start += size
    return out


def schedule(q: int, r: int) -> list[tuple[int, int, int, int]]:
    """SRS steps of rank ``r``: ``[(dist, bag_number, dst, src), ...]`` for steps ``i = 1..l``."""
    l = num_steps(q)
    out = []
    for i in range(1, l + 1):
        dist = 2 ** (l - i)
        out.append((dist, l - i + 1, (r + dist) % q, (r - dist) % q))
    return out


def runs(first: int, size: int, q: int) -> list[tuple[int, int]]:
    """Blocks ``first, first+1, ..., first+size-1`` (mod q) as contiguous ``(start, stop)`` slices."""
    first %= q
    if size <= 0:
        return []
    if first + size <= q:
        return [(first, first + size)]
    return [(first, q), (0, first + size - q)]
