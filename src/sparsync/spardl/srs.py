"""Spar-Reduce-Scatter (SparDL paper, Algorithm 1 lines 4-11) over fixed-capacity messages.

A block is sparsified (exact top-``kb`` by magnitude, :func:`~sparsync.spardl.blocksel.block_topk`)
only at the moment it is sent, after everything received for it has been added in; the preserved
block is sparsified once more at the end. All blocks of a bag travel in one message of exactly
``|bag| * kb`` (index, value) pairs (blocks with fewer nonzeros carry zero values), so the receiver
knows every size: ``ceil(log2 q)`` rounds, ``(q-1) * kb`` pairs received, no size header.
Selections are batched over the contiguous runs of a bag (2-D views of the ``[q, bs]`` block matrix).
"""

from __future__ import annotations

import contextlib

import torch

from .bags import bags, runs, schedule
from .blocksel import block_topk
from .wire import pack, pair_bytes, unpack

__all__ = ["spar_reduce_scatter"]


def _null(_key):
    return contextlib.nullcontext()


def spar_reduce_scatter(comm, work, kb: int, group: list[int], pos: int, timed=_null, scratch=None):
    """Run SRS among ``group`` (global ranks; this rank is ``group[pos]``) on ``work`` (WorkBuffer).

    Returns ``(idx, vals)`` of the preserved block ``pos``: exactly ``kb`` block-local indices
    (int64, sorted) and their reduced values. ``work`` becomes this rank's in-procedure store.
    """
    q = len(group)
    X = work.blocks
    bs = work.bs
    dtype = X.dtype
    pb = pair_bytes(dtype)
    my_bags = bags(q, pos)
    for _dist, j, dst, src in schedule(q, pos):
        m = len(my_bags[j])
        with timed("select"):
            idx_parts, val_parts = [], []
            for a, b in runs(my_bags[j][0], m, q):
                rows = X[a:b]
                sel = block_topk(rows, kb, scratch)
                idx_parts.append(sel)
                val_parts.append(rows.gather(1, sel))
                work.zero_selected(rows, a, sel, vals=val_parts[-1])
            msg = pack(torch.cat(idx_parts) if len(idx_parts) > 1 else idx_parts[0],
                       torch.cat(val_parts) if len(val_parts) > 1 else val_parts[0])
        with timed("comm"):
            got = comm.sendrecv(msg, group[dst], group[src], recv_numel=m * kb * pb, recv_dtype=torch.uint8)
        with timed("select"):
            ridx, rvals = unpack(got, m, kb, dtype)
            blocks = torch.tensor([(pos + x) % q for x in range(m)], dtype=torch.int64, device=X.device)
            work.add((ridx + blocks[:, None] * bs).view(-1), rvals.view(-1))
    with timed("select"):
        rows = X[pos:pos + 1]
        sel = block_topk(rows, kb, scratch)
        vals = rows.gather(1, sel)
        work.zero_selected(rows, pos, sel, vals=vals)
    return sel[0], vals[0]  # block_topk's columns are ascending
