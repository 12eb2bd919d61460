"""TopkA-style baseline: all-gather every rank's (indices, values), then sum (SparCML/SparDL "TopkA").

Each rank encodes its vector in the stream format (:mod:`sparsync.sparse`), so a vector denser than
the break-even point travels dense. Counts are exchanged first (``allgatherv``); the payloads are
padded to the largest and all-gathered by gloo's ring.

Cost (ring all-gather, per rank, ``m`` = largest wire size in bytes over ranks)::

    rounds = P - 1,   bytes_received = bytes_sent = (P - 1) * m

(with every rank sending ``k`` sparse pairs: ``m = 8 + k*(c + isize)``; the documents' recursive
doubling version has ``log2 P`` rounds and the same ``(P-1)k`` volume).

Summation is in rank order, so every rank computes bitwise the same result:
:func:`~sparsync.sparse.sum_streams` concatenates the ``P`` sparse streams and sorts once (``O(Pk log
Pk)``, no pass over the ``n`` entries: the result stays a sparse vector while it is smaller), or, with
``dense=True`` (the ``topka`` reducer, which needs the dense sum anyway) and whenever a stream is
dense, scatter-adds into a dense buffer, one :func:`~sparsync.sparse.add_at` per rank (indices within one rank are
unique). Both give ``0 + v_0 + v_1 + ...`` per index. Values that travel in half precision
(fp16/bf16, a reducer's ``value_dtype``) are summed in fp32, so no mass is lost in the sum.
"""

from __future__ import annotations

import torch

from ..sparse import SparseVec, decode, encode, sum_in_rank_order, sum_streams
from .registry import register


@register("allgather")
def allgather(sv: SparseVec, comm, dense: bool = False, out: torch.Tensor | None = None, **_):
    """Exact sum of every rank's ``sv``: a dense tensor with ``dense=True`` (summed into ``out``, a
    zero-filled buffer of ``sv.numel`` elements, when given), else a payload (SparseVec while the
    union is smaller than dense)."""
    bufs = comm.allgatherv(encode(sv))
    payloads = [decode(b, sv.numel, sv.dtype) for b in bufs]
    acc_dtype = torch.promote_types(sv.dtype, torch.float32)  # half values on the wire: sum in fp32
    if dense:
        return sum_in_rank_order(payloads, sv.numel, acc_dtype, sv.device, out=out)
    return sum_streams(payloads, sv.numel, acc_dtype, sv.device)


def allgather_cost(P, n, k, value_bytes=4, index_bytes=4, **_):
    """Ring all-gather of every rank's stream: ``P-1`` rounds, ``(P-1) * (8 + min(k(c+isize), n*isize))``
    bytes received (sparse while ``k(c+isize) < n*isize``, else dense; 8-byte header)."""
    m = 8 + (k * (index_bytes + value_bytes) if k * (index_bytes + value_bytes) < n * value_bytes else n * value_bytes)
    return {"rounds": P - 1, "bytes_received": (P - 1) * m}


register("allgather", cost=allgather_cost)(allgather)
