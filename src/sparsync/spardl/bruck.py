"""Bruck all-gather for any group size (Bruck et al., IEEE TPDS 1997; SparDL paper §5).

Member ``r`` of a group of ``p`` starts with ``buf = [own]``; at round ``s`` (``2^s < p``) it sends
the first ``cnt = min(2^s, p - 2^s)`` items to ``(r - 2^s) mod p`` and appends ``cnt`` items received
from ``(r + 2^s) mod p``. Afterwards ``buf[j]`` is the item of member ``(r + j) mod p``; we rotate to
canonical member order. ``ceil(log2 p)`` rounds, ``p - 1`` items received.

Items are uint8 buffers of one fixed size known to every member (SparDL pads blocks to ``kb``/``L``
pairs, B-SAG to ``h`` pairs), so every message has a known size and no size header travels.
"""

from __future__ import annotations

import torch

__all__ = ["bruck_allgather", "bruck_rounds"]


def bruck_rounds(p: int, r: int) -> list[tuple[int, int, int, int]]:
    """``[(dist, cnt, dst, src), ...]`` for member ``r`` of a group of ``p``."""
    out = []
    s = 0
    while 2**s < p:
        d = 2**s
        out.append((d, min(d, p - d), (r - d) % p, (r + d) % p))
        s += 1
    return out


def bruck_allgather(comm, item: torch.Tensor, group: list[int], pos: int) -> list[torch.Tensor]:
    """All members' items (uint8, equal sizes) in group order; ``group[pos]`` is this rank."""
    p = len(group)
    nbytes = item.numel()
    buf = [item]
    for _d, cnt, dst, src in bruck_rounds(p, pos):
        msg = torch.cat(buf[:cnt]) if cnt > 1 else buf[0]
        got = comm.sendrecv(msg, group[dst], group[src], recv_numel=cnt * nbytes, recv_dtype=torch.uint8)
        buf.extend(got.split(nbytes) if cnt > 1 else [got])
    return [buf[(j - pos) % p] for j in range(p)]
