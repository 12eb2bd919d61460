"""Spar-All-Gather across teams: R-SAG (``d = 2^i``) and B-SAG (any ``d``), SparDL paper §6-7.

Teams are contiguous (team ``j = w // q``, local rank ``r = w % q``); the SAG group of ``w`` is
``{j*q + r : j = 0..d-1}`` (the members holding block ``r`` of their own team).

R-SAG: ``log2 d`` exchanges with the member of team ``j XOR 2^t``, each of exactly ``L`` pairs (pad
with zero values); both partners sum in canonical team order (lower team first), keep the top-``L``
(ties -> smaller index) and store ``2^-(t+1)`` of the discard in ``R`` (the corrected share:
after exchange ``t`` the data is held by ``2^(t+1)`` workers).

B-SAG: keep the top-``h`` of the held block (``h`` from Algorithm 2, :mod:`.controller`), store the
rest in ``R`` in full, Bruck all-gather the ``h``-pair lists inside the group, sum them in canonical
team order, keep the top-``L`` and store ``1/d`` of the discard on every member.

Sums use a stable sort + a scatter-add over the concatenation in team order
(:func:`sparsync.sparse.coalesce_in_order`): on CPU the scatter-add accumulates sequentially in input
order, so every member computes bitwise the same sum (on CUDA only two-operand sums are order-free;
B-SAG with ``d >= 3`` on GPU would need a sorted segment sum).
"""

from __future__ import annotations

import contextlib

import torch

from .blocksel import topk_det
from .bruck import bruck_allgather
from ..sparse import coalesce_in_order
from .wire import pack, pair_bytes, unpack

__all__ = ["b_sag", "coalesce", "pad_to", "r_sag"]


def _null(_key):
    return contextlib.nullcontext()


def coalesce(idx: torch.Tensor, vals: torch.Tensor, numel: int | None = None):
    """Sorted unique indices and their summed values, in input order
    (:func:`sparsync.sparse.coalesce_in_order`; ``numel``: a bound of the indices, if known)."""
    return coalesce_in_order([idx], [vals], numel)


def pad_to(idx: torch.Tensor, vals: torch.Tensor, c: int):
    """Exactly ``c`` pairs: pad with (index 0, value 0) — harmless, every consumer sums."""
    m = idx.numel()
    if m == c:
        return idx, vals
    if m > c:
        raise ValueError(f"list of {m} pairs does not fit capacity {c}")
    return (torch.cat([idx, idx.new_zeros(c - m)]), torch.cat([vals, vals.new_zeros(c - m)]))


def r_sag(comm, idx, vals, L: int, group: list[int], team: int, work, block: int, timed=_null):
    """Recursive-doubling SAG; returns the block (``L`` pairs), identical on all group members."""
    d = len(group)
    pb = pair_bytes(vals.dtype)
    base = block * work.bs
    t = 0
    while (1 << t) < d:
        partner = team ^ (1 << t)
        with timed("comm"):
            got = comm.sendrecv(pack(idx, vals), group[partner], group[partner],
                                recv_numel=L * pb, recv_dtype=torch.uint8)
        with timed("select"):
            pi, pv = unpack(got, 1, L, vals.dtype)
            pi, pv = pi[0], pv[0]
            if team < partner:
                ci, cv = torch.cat([idx, pi]), torch.cat([vals, pv])
            else:
                ci, cv = torch.cat([pi, idx]), torch.cat([pv, vals])
            si, sv = coalesce(ci, cv, work.bs)
            ki, kv, di, dv = topk_det(si, sv, L)
            work.add(base + di, dv * (2.0 ** -(t + 1)))
            idx, vals = pad_to(ki, kv, L)
        t += 1
    return idx, vals


def b_sag(comm, idx, vals, L: int, h: int, group: list[int], team: int, work, block: int, timed=_null):
    """Bruck-based SAG with pre-selection ``h``; returns ``(idx, vals, N_t)``, identical on the group."""
    d = len(group)
    base = block * work.bs
    with timed("select"):
        si, sv = coalesce(idx, vals, work.bs)
        ki, kv, di, dv = topk_det(si, sv, h)
        work.add(base + di, dv)
        item = pack(*pad_to(ki, kv, h))
    with timed("comm"):
        items = bruck_allgather(comm, item, group, team)
    with timed("select"):
        parts = [unpack(x, 1, h, vals.dtype) for x in items]  # canonical team order
        si, sv = coalesce(torch.cat([p[0][0] for p in parts]), torch.cat([p[1][0] for p in parts]), work.bs)
        n_t = int((sv != 0).sum())
        ki, kv, di, dv = topk_det(si, sv, L)
        work.add(base + di, dv / d)
        idx, vals = pad_to(ki, kv, L)
    return idx, vals, n_t
