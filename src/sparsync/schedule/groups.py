"""Merge groups -> reducer groups: the dtype/device/sparse split and the residual carry-over at a plan switch.

A merge plan (:mod:`.merge`) gives consecutive runs of parameters in gradient-ready order. Before
they become communication groups (one reducer and one flat buffer each) they are split so that a
group never mixes dtypes or devices, and a parameter on the sparse path (``reduce_sparse``) travels
alone. When the plan changes (end of profiling for ``mgwfbp``/``optimal``), residuals move with
their parameters: error feedback must not lose mass at a switch (the
conservation identity of :mod:`sparsync.reducers.base`).
"""

from __future__ import annotations

import torch

__all__ = ["check_cover", "migrate_reducers", "split_groups"]


def split_groups(groups, params, sparse_path) -> list[list[int]]:
    """Split each group at dtype/device boundaries; parameters in ``sparse_path`` become singletons."""
    out = []
    for g in groups:
        cur, key = [], None
        for i in g:
            p = params[i]
            k = (p.dtype, p.device)
            if i in sparse_path:
                if cur:
                    out.append(cur)
                out.append([i])
                cur, key = [], None
                continue
            if cur and k != key:
                out.append(cur)
                cur = []
            cur.append(i)
            key = k
        if cur:
            out.append(cur)
    return out


def check_cover(groups, n: int) -> None:
    if sorted(i for g in groups for i in g) != list(range(n)):
        raise RuntimeError("internal error: merge groups do not cover every parameter exactly once")


def migrate_reducers(old_groups, old_reducers, new_groups, numels, new_reducer) -> list:
    """Reducers for ``new_groups``: unchanged groups keep theirs (all state), new groups get a fresh
    reducer whose residual is re-assembled from the parameters' pieces and whose step counter is kept.
    """
    same = {tuple(g): r for g, r in zip(old_groups, old_reducers)}
    per_param, step = {}, max(r.step for r in old_reducers)
    for g, r in zip(old_groups, old_reducers):
        if r.residual is not None:
            for i, piece in zip(g, torch.split(r.residual, [numels[i] for i in g])):
                per_param[i] = piece
    out = []
    for g in new_groups:
        r = same.get(tuple(g))
        if r is None:
            r = new_reducer()
            r.step = step
            if all(i in per_param for i in g):
                r.residual = torch.cat([per_param[i] for i in g]).clone()
                r.numel = r.residual.numel()
        out.append(r)
    return out
