"""``topka``: local exact top-k with local error feedback, then the all-gather sum (TopkA).

Per step: ``acc = grad + residual``; send the ``k`` entries of largest ``|acc|``; the rest is the new
residual (SparCML, Renggli et al., SC 2019, Algorithm 2). Communication: the ``allgather``
collective (``rounds = P-1``, ``(P-1)*m`` bytes each way for a wire size ``m``); the union can grow
to ``P*k`` entries (gradient build-up). Conserving, also with ``value_dtype="fp16"|"bf16"`` (values
rounded before sending, rounding error kept in the residual, sum in fp32).

Passes over the ``n`` entries per call: ``acc = grad + residual`` into a recycled buffer
(:class:`~sparsync.reducers.memory.ErrorFeedback`: no fresh allocation, no page faults), one
read by the exact top-k kernel, one zero fill of the recycled output
(:meth:`~sparsync.reducers.base.Reducer.zeros_output`); everything else is ``O(P k)``.
"""

from __future__ import annotations

import torch

from ..collectives.allgather import allgather
from ..select.topk import topk_abs
from ..sparse import SparseVec
from .base import Reducer
from .registry import register


@register("topka")
class TopkAReducer(Reducer):
    accepts_fold = True
    checks_input = True
    supports_value_dtype = True  # half values on the wire, summed in fp32 by the allgather collective
    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, **_):
        """The all-gather collective's formula for ``k`` entries per rank
        (:func:`~sparsync.collectives.allgather.allgather_cost`: ``P-1`` rounds, ``(P-1)*m`` bytes)."""
        from ..collectives.allgather import allgather_cost

        return allgather_cost(P, n, k, value_bytes=value_bytes, index_bytes=index_bytes)

    def _reduce(self, grad):
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx, vals = topk_abs(acc, self.k, self.scratch)
            vals = self.wire_values(vals)
            self.memory.keep(acc, idx, vals)
        self.stats["selected"] = idx.numel()
        with self.timed("comm"):
            out = self.zeros_output(self.numel, torch.promote_types(vals.dtype, torch.float32), acc.device)
            return allgather(SparseVec(idx, vals, self.numel, check=False), self.comm, dense=True, out=out)
