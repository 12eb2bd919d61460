"""``gtopk``: gTop-k all-reduce (Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification for Low Bandwidth Networks", ICDCS 2019; a baseline of the SparDL paper).

Power-of-two ``P`` only (a clear ``ValueError`` otherwise). Per step: exact local top-``k`` of
``acc = grad + residual``; a binomial-tree reduction in ``log2 P`` rounds — at round ``i`` rank
``r`` with ``r mod 2^(i+1) = 2^i`` sends its ``k`` pairs to ``r - 2^i``, which sums (lower rank first)
and re-selects the top-``k`` (ties -> smaller index); then rank 0 broadcasts the final ``k`` pairs
(binomial tree, ``ceil(log2 P)`` rounds). Every message has exactly ``k`` pairs (zero-value padding),
so no size header. Critical path: ``2 log2 P`` rounds and ``4 log2 P * k`` units (Table I,
:meth:`GTopkReducer.table_cost`); per rank the ledger shows half of that at most: rank 0 receives
``log2 P * k`` pairs in the reduction (:meth:`GTopkReducer.predicted_cost`, exact).

Passes over the ``n`` entries per call (the rest is ``O(k log P)``): ``acc = grad + residual`` into a
recycled buffer (:class:`~sparsync.reducers.memory.ErrorFeedback`), one read by the exact top-k
kernel, one zero fill of the recycled output (:meth:`~sparsync.reducers.base.Reducer.zeros_output`).
The residual is written by the memory only: ``take`` clears the ``k`` selected entries, ``put_back``
returns ``O(k log P)`` of them (or of the dropped sums) after the broadcast.
The global-set test of ``residuals="partial"`` goes through a persistent flag vector
(:class:`~sparsync.sparse.IndexFlags`), the merges through one stable sort of ``2k`` entries
(:func:`sparsync.sparse.coalesce_in_order`).

Residuals: ``residuals="partial"`` (default, the gTop-k paper's rule): local residual plus the locally
selected values whose index is not in the global top-k set (end-procedure); values dropped at a merge
at an index that survives elsewhere are lost, so it is not conserving. ``residuals="global"``: the
merging rank keeps what it drops (SparDL-style in-procedure store) -> conserving.
"""

from __future__ import annotations

import torch

from ..spardl.blocksel import topk_det
from ..spardl.teams import coalesce, pad_to
from ..spardl.wire import pack, pair_bytes, unpack
from ..sparse import IndexFlags, add_at
from .base import Reducer
from .capabilities import OptionFact
from .registry import register
from ..select.exact import topk_indices as select_topk


@register("gtopk")
class GTopkReducer(Reducer):
    accepts_fold = True
    checks_input = True
    #: the default instance (``residuals="partial"``) is not conserving; ``residuals="global"`` is
    conserving = OptionFact(False, lambda r: r.residuals == "global")

    def __init__(self, comm, density=0.01, residuals="partial", **rest):
        super().__init__(comm, density=density, **rest)
        P = comm.world_size
        if P & (P - 1):
            raise ValueError(f"gtopk needs a power-of-two world size, got P={P} (use spardl or oktopk)")
        if residuals not in ("partial", "global"):
            raise ValueError(f"gtopk residuals must be 'partial' or 'global', got {residuals!r}")
        self.residuals = residuals
        self._scratch: dict = {}
        self._global_set = IndexFlags()

    def _reduce(self, grad):
        comm = self.comm
        P, w, k = comm.world_size, comm.rank, self.k
        pb = pair_bytes(grad.dtype)
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx = select_topk(acc, k, self._scratch)
            vals, _ = self.memory.take(acc, idx)  # the memory holds acc with idx cleared
            own_idx, own_vals = idx, vals
        self.stats["selected"] = k
        drops = []
        with comm.phase("gtopk:reduce"):
            i = 0
            while (1 << i) < P:
                step = 1 << i
                if w % (2 * step) == step:
                    with self.timed("comm"):
                        comm.send(pack(idx, vals), w - step, fixed=True)
                    break
                if w % (2 * step) == 0:
                    with self.timed("comm"):
                        got = comm.recv(w + step, numel=k * pb, dtype=torch.uint8)
                    with self.timed("select"):
                        pi, pv = unpack(got, 1, k, grad.dtype)
                        si, sv = coalesce(torch.cat([idx, pi[0]]), torch.cat([vals, pv[0]]), self.numel)
                        ki, kv, di, dv = topk_det(si, sv, k)
                        drops.append((di, dv))
                        idx, vals = pad_to(ki, kv, k)
                i += 1
        with comm.phase("gtopk:broadcast"), self.timed("comm"):
            buf = pack(idx, vals) if w == 0 else torch.empty(k * pb, dtype=torch.uint8, device=grad.device)
            buf = comm.broadcast(buf, 0) if P > 1 else buf
        with self.timed("select"):
            fi, fv = unpack(buf, 1, k, grad.dtype)
            out = self.zeros_output(self.numel, grad.dtype, grad.device)  # recycled: no page faults
            add_at(out, fi[0], fv[0])
            if self.residuals == "partial":
                # own selected values that did not make it into the global set go back
                back = ~self._global_set.isin(own_idx, fi[0], self.numel)
                self.memory.put_back(own_idx[back], own_vals[back])
            else:
                for di, dv in drops:  # what this rank dropped at its merges (unique per merge)
                    self.memory.put_back(di, dv)
        return out

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, **_):
        """What this code's ledger shows, maximum over ranks: ``2 log2 P`` rounds; rank 0 receives the
        most, ``log2 P`` lists of ``k`` pairs in the reduction (the others ``tz(r) + 1`` lists, ``tz`` =
        trailing zero bits of ``r``, the ``+1`` being the broadcast). The paper's Table I figure
        (critical path ``4 log2 P k`` units) is :meth:`table_cost`."""
        lg = (P - 1).bit_length()
        return {"rounds": 2 * lg, "bytes_received": lg * k * (index_bytes + value_bytes)}

    @staticmethod
    def table_cost(P, k):
        """Table I: ``2 log2 P`` rounds and ``4 log2 P k`` units (a COO pair = 2 units) on the critical path."""
        lg = (P - 1).bit_length()
        return {"rounds": 2 * lg, "units": 4 * lg * k}
