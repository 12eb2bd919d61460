"""``topkdsa``: SparCML's split all-gather (Renggli et al., SC 2019; TopkDSA in the SparDL paper).

Per step: ``acc = grad + residual``; exact local top-``k`` (one-pass kernel,
:func:`sparsync.select.exact.topk_indices`) with local error feedback (conserving: everything selected
is delivered exactly). Then

1. **reduce-scatter by direct sends**: the index space is cut into ``P`` equal ranges; every rank sends
   its entries of range ``j`` to rank ``j`` (``P-1`` messages, one round each) and sums what it
   receives, in rank order, into its dense range;
2. **growing all-gather** (Bruck, any ``P``, ``ceil(log2 P)`` rounds): each range travels in SparCML's
   stream format (:func:`sparsync.sparse.encode`), i.e. it switches to dense as soon as the sparse form
   is not smaller — the union can grow up to ``P*k`` entries per range.

Passes over the ``n`` entries per call: ``acc = grad + residual`` into a recycled buffer
(:class:`~sparsync.reducers.memory.ErrorFeedback`), one read by the exact top-k kernel, one write
of the recycled dense output (:meth:`~sparsync.reducers.base.Reducer.output_buffer`); the owner's sum
of its range is sparse (:func:`sparsync.sparse.sum_streams`, one sort of the ~``k`` received entries)
while it is smaller than dense, so no dense scratch of ``n/P`` either.

Sizes are data dependent, so both phases pay the ledger's size header (one int64 per message) and each
stream item carries its own 8-byte count. Cost: rounds ``(P-1) + ceil(log2 P)`` (Table I says
``P + 2 log P``); bytes in ``[4(P-1)/P k, (P-1)/P (2k+n)]`` units (index and value 4 bytes each) plus
headers, for indices spread evenly over the ranges.
"""

from __future__ import annotations

import torch

from ..select.exact import topk_indices
from ..spardl.bruck import bruck_rounds
from ..sparse import HEADER_BYTES, SparseVec, decode, encode, index_dtype_for, set_at, sum_streams
from .base import Reducer
from .registry import register


def select_topk(acc: torch.Tensor, k: int, scratch: dict | None = None) -> torch.Tensor:
    """Sorted indices of the exact top-``k`` ``|acc|`` (:func:`sparsync.select.exact.topk_indices`).

    ``scratch``: a dict the reducer keeps, so the selection buffers are reused across steps.
    """
    return topk_indices(acc, k, scratch)


def _item_len(buf: torch.Tensor, start: int, numel: int, vb: int) -> int:
    count = int(buf[start:start + HEADER_BYTES].clone().view(torch.int64)[0])
    if count == numel:
        return HEADER_BYTES + numel * vb
    ib = torch.empty(0, dtype=index_dtype_for(numel)).element_size()
    return HEADER_BYTES + count * (ib + vb)


@register("topkdsa")
class TopkDSAReducer(Reducer):
    accepts_fold = True
    checks_input = True

    def __init__(self, comm, density=0.01, **rest):
        super().__init__(comm, density=density, **rest)
        self._scratch: dict = {}

    def _reduce(self, grad):
        comm = self.comm
        P, w, n = comm.world_size, comm.rank, self.numel
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx = select_topk(acc, self.k, self._scratch)
            vals, _ = self.memory.take(acc, idx)
            ps = -(-n // P)
            bounds = [min(n, j * ps) for j in range(P + 1)]
            cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=idx.dtype, device=idx.device)).tolist()
            parts = [SparseVec(idx[cuts[j]:cuts[j + 1]] - bounds[j], vals[cuts[j]:cuts[j + 1]],
                               bounds[j + 1] - bounds[j], check=False) for j in range(P)]
        self.stats["selected"] = idx.numel()
        lo, hi = bounds[w], bounds[w + 1]
        with comm.phase("topkdsa:reduce-scatter"):
            with self.timed("comm"):
                sends = {j: encode(parts[j]) for j in range(P) if j != w}
                got = comm.exchange(sends, {j: torch.uint8 for j in range(P) if j != w}) if P > 1 else {}
            with self.timed("select"):  # rank order: identical sums everywhere; sparse while it is smaller
                mine = sum_streams([parts[w] if j == w else decode(got[j], hi - lo, acc.dtype) for j in range(P)],
                                   hi - lo, acc.dtype, acc.device)
                item = encode(mine)
        with comm.phase("topkdsa:allgather"):
            items = self._bruck_var(item, [bounds[j + 1] - bounds[j] for j in range(P)], acc.dtype)
        with self.timed("select"):
            out = self.output_buffer(n, acc.dtype, acc.device)  # recycled; every range is written below
            for j in range(P):
                pj = decode(items[j], bounds[j + 1] - bounds[j], acc.dtype)
                seg = out[bounds[j]:bounds[j + 1]]
                if isinstance(pj, SparseVec):
                    seg.zero_()
                    set_at(seg, pj.indices, pj.values)
                else:
                    seg.copy_(pj)
        return out

    def _bruck_var(self, item, numels, dtype):
        """Bruck all-gather of variable-size stream items (one size header per message)."""
        comm = self.comm
        P, w = comm.world_size, comm.rank
        vb = torch.empty(0, dtype=dtype).element_size()
        buf = [item]
        for _d, cnt, dst, src in bruck_rounds(P, w):
            with self.timed("comm"):
                got = comm.sendrecv(torch.cat(buf[:cnt]), dst, src, recv_dtype=torch.uint8)
            off = 0
            for x in range(cnt):
                m = (src + x) % P
                ln = _item_len(got, off, numels[m], vb)
                buf.append(got[off:off + ln])
                off += ln
        return [buf[(j - w) % P] for j in range(P)]

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, **_):
        lg = (P - 1).bit_length()
        u = (index_bytes + value_bytes) / 2  # one "unit" of Table I (a COO pair is 2 units)
        return {"rounds": (P - 1) + lg,
                "bytes_received": (4 * (P - 1) / P * k * u, (P - 1) / P * (2 * k + n) * u)}
