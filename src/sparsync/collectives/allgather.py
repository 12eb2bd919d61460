"""TopkA-style baseline: all-gather every rank's (indices, values), then sum (SparCML/SparDL "TopkA").

Each rank encodes its vector in the stream format (:mod:`sparsync.sparse`: int32 indices while
``numel`` fits), so a vector denser than the break-even point travels dense. Counts are exchanged
first; the payloads are padded to the largest and all-gathered by gloo's ring straight into one
flat buffer (:meth:`~sparsync.comm.Comm.allgatherv_flat`: no per-rank output tensors).

Cost (ring all-gather, per rank, ``m`` = largest wire size in bytes over ranks)::

    rounds = P - 1,   bytes_received = bytes_sent = (P - 1) * m

(with every rank sending ``k`` sparse pairs: ``m = 8 + k*(c + isize)``; the documents' recursive
doubling version has ``log2 P`` rounds and the same ``(P-1)k`` volume).

Summation is in rank order, so every rank computes bitwise the same result. With ``dense=True``
(the dense sum: :func:`~sparsync.collectives.sparse_allreduce_dense`, the ``topka`` reducer) every
rank's stream is scatter-added, as it lies in the gathered buffer (int32 index views, no decode
copies, no sort), into one zero-filled dense buffer, one :func:`~sparsync.sparse.add_at` per rank
(indices within one rank are unique): ``0 + v_0 + v_1 + ...`` per index - the plain all-gather a
user writes, with one ``index_add_`` over the concatenation, computes the same. Otherwise
:func:`~sparsync.sparse.sum_streams` concatenates the ``P`` sparse streams and sorts once (``O(Pk log
Pk)``, no pass over the ``n`` entries: the result stays a sparse vector while it is smaller).
Values that travel in half precision (fp16/bf16, a reducer's ``value_dtype``) are summed in fp32,
so no mass is lost in the sum.
"""

from __future__ import annotations

import torch

from ..recycle import fill_zero
from ..sparse import SparseVec, add_at, decode, decode_views, encode, index_dtype_for, sum_dtype, sum_streams
from .registry import register


@register("allgather", dense=True)
def allgather(sv: SparseVec, comm, dense: bool = False, out: torch.Tensor | None = None, out_zeroed: bool = True,
              **_):
    """Exact sum of every rank's ``sv``: a dense tensor with ``dense=True`` (summed into ``out``, a
    buffer of ``sv.numel`` elements of the sum dtype, zero-filled unless ``out_zeroed=False``, when
    given), else a payload (SparseVec while the union is smaller than dense)."""
    flat, counts = comm.allgatherv_flat(encode(sv))
    m = max(counts)
    streams = [flat[r * m: r * m + c] for r, c in enumerate(counts)]
    acc_dtype = sum_dtype(sv.dtype)  # half values on the wire: sum in fp32
    if not dense:
        return sum_streams([decode(b, sv.numel, sv.dtype) for b in streams], sv.numel, acc_dtype, sv.device)
    if out is None:
        out = torch.zeros(sv.numel, dtype=acc_dtype, device=sv.device)
    elif not out_zeroed:
        fill_zero(out)
    for b in streams:
        idx, vals = decode_views(b, sv.numel, sv.dtype)
        if idx is None:
            out += vals
        else:
            add_at(out, idx, vals.to(acc_dtype))
    return out


def allgather_cost(P, n, k, value_bytes=4, index_bytes=None, **_):
    """Ring all-gather of every rank's stream: ``P-1`` rounds, ``(P-1) * (8 + min(k(c+isize), n*isize))``
    bytes received (sparse while ``k(c+isize) < n*isize``, else dense; 8-byte header). ``compute``:
    the sort of the ``P k`` gathered items (a sparse sum), or a dense pass when they reach ``n``."""
    if index_bytes is None:
        index_bytes = torch.empty(0, dtype=index_dtype_for(n)).element_size()
    sparse = k * (index_bytes + value_bytes) < n * value_bytes
    m = 8 + (k * (index_bytes + value_bytes) if sparse else n * value_bytes)
    items = P * k if sparse else P * n
    work = {"sparse_items": items, "dense_elems": 0} if items < n else {"sparse_items": 0, "dense_elems": n + items}
    return {"rounds": P - 1, "bytes_received": (P - 1) * m, "compute": work}


register("allgather", cost=allgather_cost, dense=True)(allgather)
