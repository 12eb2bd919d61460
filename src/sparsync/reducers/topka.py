"""``topka``: local exact top-k with local error feedback, then the all-gather sum (TopkA).

Per step: ``acc = grad + residual``; send the ``k`` entries of largest ``|acc|``; the rest is the new
residual (SparCML, Renggli et al., SC 2019, Algorithm 2). Communication: the ``allgather``
collective (``rounds = P-1``, ``(P-1)*m`` bytes each way for a wire size ``m``); the union can grow
to ``P*k`` entries (gradient build-up). Conserving, also with ``value_dtype="fp16"|"bf16"`` (values
rounded before sending, rounding error kept in the residual, sum in fp32).

Options shared with ``sparseloco`` (Sarfi et al., "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706, 2025):

* ``ef_decay`` in (0, 1]: ``acc = ef_decay * residual + grad`` (1, the default: the above, bit for
  bit); below 1 the residual sheds mass by design, so the instance is not ``conserving``, and the
  fold of momentum correction is off (the memory offers no fold target).
* ``value_bits``: the values' format, which decides over ``value_dtype`` when both are given
  (``DiLoCo`` adds ``value_dtype="fp16"`` by default). 32 / 16: ``value_dtype`` fp32 / fp16, the
  stream above. 2 / 4 / 8: codes with a per-tensor table of bin means
  (:func:`~sparsync.select.quantise.quantise`), the quantisation error kept in the residual
  (conservation up to fp32 rounding, so not ``conserving``); the message is the ``k`` global indices
  packed in ``ceil(log2 n)`` bits and the packed codes and table
  (:func:`~sparsync.select.quantise.encode_message`), all-gathered (every rank's has the same size),
  decoded by every rank and summed in rank order: bitwise the same on every rank.

Passes over the ``n`` entries per call: ``acc = grad + residual`` into a recycled buffer
(:class:`~sparsync.reducers.memory.ErrorFeedback`: no fresh allocation, no page faults), one
read by the exact top-k kernel, one zero fill of the recycled output
(:meth:`~sparsync.reducers.base.Reducer.zeros_output`); everything else is ``O(P k)``.
"""

from __future__ import annotations

import torch

from ..collectives.allgather import allgather
from ..select.quantise import bits_for, check_value_bits, encode_message, payload_bytes, sum_messages
from ..select.topk import topk_abs
from ..sparse import SparseVec
from .base import Reducer
from .capabilities import OptionFact, wire_conserves
from .memory import decay_memory
from .registry import register


@register("topka")
class TopkAReducer(Reducer):
    accepts_fold = True
    checks_input = True
    supports_value_dtype = True  # half values on the wire, summed in fp32 by the allgather collective
    #: not with decay (it sheds mass by design) nor packed values (a table's means round in fp32)
    conserving = OptionFact(True, lambda r: r.ef_decay == 1.0 and not r.packed and wire_conserves(r))

    def __init__(self, comm, density: float = 0.01, value_bits: int | None = None, ef_decay: float = 1.0, **rest):
        if value_bits is not None:
            value_bits = check_value_bits(value_bits, "topka")
            rest["value_dtype"] = "fp16" if value_bits == 16 else "fp32"  # value_bits decides
        super().__init__(comm, density=density, **rest)
        self.value_bits = value_bits
        self.ef_decay = decay_memory(self.memory, ef_decay, self.name)
        self.packed = value_bits is not None and value_bits < 16  # codes and a table: the packed message

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, value_bits=None, **_):
        """The all-gather collective's formula for ``k`` entries per rank
        (:func:`~sparsync.collectives.allgather.allgather_cost`: ``P-1`` rounds, ``(P-1)*m`` bytes);
        ``value_bits`` 2 / 4 / 8: ``m`` = :func:`~sparsync.select.quantise.payload_bytes`."""
        from ..collectives.allgather import allgather_cost

        if value_bits is not None and value_bits < 16:
            return {"rounds": P - 1, "bytes_received": (P - 1) * payload_bytes(k, bits_for(n), value_bits)}
        if value_bits is not None:
            value_bytes = value_bits // 8
        return allgather_cost(P, n, k, value_bytes=value_bytes, index_bytes=index_bytes)

    def _reduce(self, grad):
        if self.packed:
            return self._reduce_packed(grad)
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx, vals = topk_abs(acc, self.k, self.scratch)
            vals = self.wire_values(vals)
            self.memory.keep(acc, idx, vals)
        self.stats["selected"] = idx.numel()
        with self.timed("comm"):
            out = self.zeros_output(self.numel, torch.promote_types(vals.dtype, torch.float32), acc.device)
            return allgather(SparseVec(idx, vals, self.numel, check=False), self.comm, dense=True, out=out)

    def _reduce_packed(self, grad):
        n, bits, width = self.numel, self.value_bits, bits_for(self.numel)
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx, vals = topk_abs(acc, self.k, self.scratch)
            msg, dec = encode_message(idx, width, vals, bits)
            self.memory.keep(acc, idx, dec, acc_vals=vals)  # the residual keeps the quantisation error
        self.stats["selected"] = count = idx.numel()
        with self.timed("comm"):
            parts = self.comm.allgather(msg) if self.comm.world_size > 1 else [msg]
        with self.timed("select"):
            out = self.zeros_output(n, torch.promote_types(acc.dtype, torch.float32), acc.device)
            return sum_messages(parts, count, width, bits, out)
