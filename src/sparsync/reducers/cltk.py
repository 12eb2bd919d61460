"""``cltk``: CLT-k - a cyclic leader picks the top-k indices for everyone (MiCRO's baseline).

What (CLT-k, the cyclic local top-k baseline of the MiCRO paper: Yoon & Oh, 2023): at step ``t``
the leader is rank ``t mod P``. Every rank
accumulates ``acc = grad + residual``; the leader selects the ``k`` entries of largest ``|acc|`` of
*its own* accumulator (exact top-k, :func:`sparsync.select.topk.topk_abs`), broadcasts the indices,
and every rank all-reduces its values ``acc[idx]`` at those indices. Every rank zeroes ``acc[idx]``
and keeps the rest as residual (conserving: whatever a rank did not send stays in its residual).
No build-up (exactly ``k`` entries), but the other ranks wait while the leader selects, and their
own large entries wait until a leader picks them.

Passes over the ``n`` entries per call: ``acc = grad + residual`` into a recycled buffer
(:class:`~sparsync.reducers.memory.ErrorFeedback`), one read by the leader's exact top-k kernel
(leader only), one zero fill of the recycled output (:meth:`~sparsync.reducers.base.Reducer.zeros_output`).

Why: the comparison point of the MiCRO paper for "no build-up, but selection-bound".

Cost (binomial-tree broadcast of ``k`` indices, ring all-reduce of ``k`` values; per rank)::

    rounds         = ceil(log2 P) + 2 (P - 1)
    bytes_received = k * index_bytes (non-leaders; 0 at the leader) + 2 (P - 1) * k * value_bytes // P

``stats``: ``selected = k``, ``leader``.
"""

from __future__ import annotations

import math

import torch

from ..select.topk import topk_abs
from ..sparse import index_dtype_for, set_at
from .base import Reducer
from .capabilities import OptionFact
from .registry import register


@register("cltk")
class CLTKReducer(Reducer):
    accepts_fold = True
    checks_input = True
    supports_value_dtype = True  # values summed in half precision by the all-reduce: not conserving then
    value_dtype_conserving = False
    reuse_buffers = OptionFact(True, lambda r: r._reuse_buffers)  # the option of that name

    def __init__(self, comm, density: float = 0.01, reuse_buffers: bool = True, **rest):
        self._reuse_buffers = bool(reuse_buffers)  # read by Reducer.__init__
        super().__init__(comm, density=density, **rest)

    def _reduce(self, grad):
        comm, k = self.comm, self.k
        leader = self.step % comm.world_size
        itype = index_dtype_for(self.numel)
        with self.timed("select"):
            acc = self.memory.add(grad)
            if comm.rank == leader:
                idx, _ = topk_abs(acc, k, self.scratch)
                wire = idx.to(itype)
            else:
                wire = torch.empty(k, dtype=itype, device=acc.device)
        with self.timed("comm"):
            with comm.phase(self.name + ".indices"):
                idx = comm.broadcast(wire, leader).to(torch.int64)
            with comm.phase(self.name + ".values"):
                sent, vals = self.allreduce_wire_values(acc.index_select(0, idx))
        with self.timed("update"):
            self.memory.keep(acc, idx, sent)
            out = self.zeros_output(self.numel, acc.dtype, acc.device)  # recycled: no page faults
            set_at(out, idx, vals)
        self.stats.update(selected=k, leader=leader)
        return out

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, **_):
        """Per rank; ``bytes_received`` is ``(leader, non-leader)``."""
        if P <= 1:
            return {"rounds": 0, "bytes_received": 0}
        vals = 2 * (P - 1) * k * value_bytes // P
        return {"rounds": math.ceil(math.log2(P)) + 2 * (P - 1), "bytes_received": (vals, vals + k * index_bytes)}
