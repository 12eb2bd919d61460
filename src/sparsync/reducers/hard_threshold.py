"""``hard_threshold``: fixed-threshold selection with local error feedback (MiCRO's baseline).

What (the hard-threshold baseline of the MiCRO paper: Yoon & Oh, 2023): every rank sends all entries of its accumulator
``acc = grad + residual`` with ``|acc| >= threshold`` - over the *whole* gradient, so selections of
different ranks overlap (gradient build-up) - and the sparse vectors are summed by the all-gather
sum of :mod:`sparsync.collectives.allgather` (stream format: sparse, or dense once sparse would not
be smaller). The rest stays in the residual (conserving).

Why: it is the comparison point of the MiCRO paper: selection is a cheap streaming pass
(:func:`sparsync.select.threshold.threshold_indices`), but nothing controls how many entries pass,
so the achieved density drifts with the gradient scale (the paper's Fig. 1: far above the target
and rising until the learning-rate drop).

Cost (ring all-gather, per rank; ``c_r`` entries selected by rank ``r``)::

    rounds = P - 1,   bytes_received = (P - 1) * max_r (8 + min(c_r (index_bytes + value_bytes), n value_bytes))

Passes over the ``n`` entries per call: ``acc = grad + residual`` into a recycled buffer
(:class:`~sparsync.reducers.memory.ErrorFeedback`), one read by the threshold kernel, one zero
fill of the recycled output (:meth:`~sparsync.reducers.base.Reducer.zeros_output`), plus one pass per
rank whose stream travels dense (when its selection is over the sparse/dense break-even).

Options: ``threshold`` (default ``1/(2 sqrt(k))`` with ``k = density * n``, as the reference
snapshot; the density is used for nothing else), ``reuse_buffers`` (see :mod:`.memory`).

``stats``: ``selected`` = this rank's count ``c_r`` (``density = c_r / n`` - compare with
``target_density``), ``gathered`` = ``sum_r c_r`` (the upper bound of the union), ``threshold``.
"""

from __future__ import annotations

import torch

from ..sparse import sum_in_rank_order
from ..select.threshold import Workspace, check_threshold, initial_threshold, threshold_indices
from ..sparse import HEADER_BYTES, SparseVec, decode, encode, sparse_is_smaller
from .base import Reducer
from .capabilities import OptionFact
from .registry import register


@register("hard_threshold")
class HardThresholdReducer(Reducer):
    conserving = True
    accepts_fold = True
    checks_input = True
    supports_value_dtype = True  # half values on the wire, summed in fp32 (sum_in_rank_order)
    reuse_buffers = OptionFact(True, lambda r: r._reuse_buffers)  # the option of that name

    def __init__(self, comm, density: float = 0.01, threshold: float | None = None,
                 reuse_buffers: bool = True, **rest):
        self._reuse_buffers = bool(reuse_buffers)  # read by Reducer.__init__
        super().__init__(comm, density=density, **rest)
        self.threshold = None if threshold is None else check_threshold(threshold)
        self._ws = Workspace()

    def _extra_state(self) -> dict:
        return {"threshold": self.threshold}

    def _load_extra_state(self, d: dict) -> None:
        if d.get("threshold") is not None:
            self.threshold = float(d["threshold"])

    def _reduce(self, grad):
        if self.threshold is None:
            self.threshold = initial_threshold(self.k)
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx = threshold_indices(acc, self.threshold, workspace=self._ws)
            _, vals = self.memory.take(acc, idx)
        with self.timed("comm"):
            bufs = self.comm.allgatherv(encode(SparseVec(idx, vals, self.numel, check=False)))
            payloads = [decode(b, self.numel, vals.dtype) for b in bufs]
            out = sum_in_rank_order(payloads, self.numel, acc.dtype, acc.device,
                                    out=self.zeros_output(self.numel, acc.dtype, acc.device))
        gathered = sum(p.nnz if isinstance(p, SparseVec) else int(torch.count_nonzero(p)) for p in payloads)
        self.stats.update(selected=int(idx.numel()), gathered=gathered, threshold=self.threshold)
        return out

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, counts=None, **_):
        """Ring all-gather of every rank's stream; ``counts`` = per-rank selections (default all ``k``)."""
        if P <= 1:
            return {"rounds": 0, "bytes_received": 0}
        counts = [k] * P if counts is None else list(counts)
        vdt = {2: torch.float16, 4: torch.float32, 8: torch.float64}[value_bytes]

        def wire(c):
            if sparse_is_smaller(c, n, vdt):
                return HEADER_BYTES + c * (index_bytes + value_bytes)
            return HEADER_BYTES + n * value_bytes

        return {"rounds": P - 1, "bytes_received": (P - 1) * max(wire(c) for c in counts)}
