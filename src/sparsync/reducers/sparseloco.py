"""``sparseloco``: SparseLoCo's exchange - chunked top-k of decayed error feedback, low-bit values, all-gather.

Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo" (arXiv 2508.15706, 2025), the
exchange of DiLoCo's pseudo-gradients (``ss.DiLoCo(..., reducer="sparseloco")``) or of any gradient::

    r = ss.make_reducer("sparseloco", comm, density=64/4096, chunk=4096, value_bits=2, ef_decay=0.95)

Per rank and call:

1. ``acc = ef_decay * residual + grad`` (:class:`~.memory.ErrorFeedback` with ``decay``; 1 = plain
   error feedback), the input checked in the same pass;
2. in every chunk of ``chunk`` entries the ``k = round(density * chunk)`` largest ``|acc|``
   (:func:`~sparsync.select.chunked.chunked_topk`; a short last chunk sends its share);
3. the selected values quantised to ``value_bits`` (2, 4, 8: codes and a per-tensor table of bin means,
   :func:`~sparsync.select.quantise.quantise`; 16 / 32: fp16 / fp32), and the residual keeps
   ``acc - decode`` (the quantisation error too), so
   ``sum_r (ef_decay * residual_before_r + grad_r) == out + sum_r residual_after_r`` up to fp32 rounding
   (exactly with 16 / 32-bit values on exactly representable sums). ``conserving`` (the house's
   undecayed identity, bit for bit) is True only with ``ef_decay=1`` and 16 / 32-bit values: decay
   sheds the residual's mass by design (SparseLoCo's choice), and a table's means round;
4. one message per rank - chunk-local indices packed in ``log2(chunk)`` bits, the codes packed, the
   table - all-gathered (every rank's message has the same size: no count round), decoded by every
   rank and summed in rank order (one ``index_add_`` per rank, in fp32 for a half-precision gradient,
   as ``topka`` does), so ``out`` is bitwise identical on every rank. One collective: :meth:`start`
   posts it and returns a future of the same sum (``staged``; DiLoCo's ``overlap`` uses it).

Cost: the all-gather ring, ``P - 1`` rounds and ``(P - 1) m`` bytes received for a message of ``m``
bytes (:func:`~sparsync.select.quantise.payload_bytes`): at 4096 / 64 / 2 bits, 2.25 bytes per sent
entry (12-bit index, 2-bit value, the 16-byte table aside) - 146x fewer bytes than the fp32 gradient.
Passes over the ``n`` entries: the decayed sum, the chunked top-k (a batched ``topk`` and a comparison
pass), the zero fill of the output; the rest is ``O(P k)``.
"""

from __future__ import annotations

import torch

from ..select.chunked import chunked_topk, per_chunk_k, short_chunk_k
from ..select.quantise import bits_for, check_value_bits, encode_message, payload_bytes, sum_messages
from .base import Reducer
from .capabilities import OptionFact
from .memory import decay_memory
from .registry import register

__all__ = ["SparseLoCoReducer"]


def selected_count(n: int, chunk: int, k: int) -> int:
    """Entries one rank sends for a gradient of ``n``: ``k`` per full chunk and the short chunk's share."""
    full, rest = divmod(n, chunk)
    return full * k + (short_chunk_k(k, chunk, rest) if rest else 0)


@register("sparseloco")
class SparseLoCoReducer(Reducer):
    checks_input = True  # the memory's add checks the decayed sum
    #: the memory accumulates in recycled buffers (no fresh 4n-byte tensor, and its page faults, per call);
    #: a policy may fold into it when it is undecayed (``ef_decay=1``)
    accepts_fold = True
    #: the undecayed identity, bit for bit, only without decay (which sheds mass by design) and with
    #: 16 / 32-bit values (a table's means round in fp32): otherwise it holds as documented above
    conserving = OptionFact(False, lambda r: r.ef_decay == 1.0 and r.value_bits >= 16)

    def __init__(self, comm, density: float = 64 / 4096, chunk: int = 4096, value_bits: int = 2,
                 ef_decay: float = 0.95, **rest):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2:
            raise ValueError(f"sparseloco: chunk must be an integer >= 2, got {chunk!r}")
        value_bits = check_value_bits(value_bits, "sparseloco")
        super().__init__(comm, density=density, **rest)
        self.chunk, self.value_bits = int(chunk), value_bits
        self.ef_decay = decay_memory(self.memory, ef_decay, self.name)
        self.k_chunk = per_chunk_k(self.density, self.chunk)

    def _width(self, n: int) -> int:
        return bits_for(min(self.chunk, n))

    #: one collective, the all-gather of equal-size messages: :meth:`start` posts it without waiting
    staged = True

    def _reduce(self, grad):
        msg, sum_of = self._encode(grad)
        with self.timed("comm"):
            parts = self.comm.allgather(msg) if self.comm.world_size > 1 else [msg]
        return sum_of(parts)

    def _start(self, grad):
        msg, sum_of = self._encode(grad)
        P = self.comm.world_size
        fut = self.comm.allgather_into_async(msg, msg.new_empty(P * msg.numel()))
        return fut.then(lambda f: sum_of(list(f.value().view(P, -1))))  # the same messages, the same sum

    def _encode(self, grad):
        """Steps 1-3: this rank's message, and the function that sums the ranks' messages (step 4)."""
        n, bits, width = self.numel, self.value_bits, self._width(self.numel)
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx = chunked_topk(acc, self.chunk, self.k_chunk)
            vals = acc.index_select(0, idx)
            local = torch.remainder(idx, self.chunk)
            msg, dec = encode_message(local, width, vals, bits)
            self.memory.keep(acc, idx, dec, acc_vals=vals)  # the residual keeps what the decode did not carry
        self.stats["selected"] = count = idx.numel()
        dtype, device = torch.promote_types(acc.dtype, torch.float32), acc.device

        def sum_of(parts):
            with self.timed("select"):
                out = self.zeros_output(n, dtype, device)
                # the chunks' starts are the same on every rank (fixed counts per chunk)
                return sum_messages(parts, count, width, bits, out, chunk=self.chunk, k=self.k_chunk)

        return msg, sum_of

    @classmethod
    def predicted_cost(cls, P, n, k=None, chunk=4096, value_bits=2, density=None, **_):
        """The all-gather ring of one message per rank: ``P - 1`` rounds, ``(P - 1) m`` bytes received,
        ``m`` = :func:`~sparsync.select.quantise.payload_bytes` of the entries sent (``density``: the
        reducer's; else ``k / n``)."""
        kc = per_chunk_k(density if density is not None else (k / n if k else 64 / 4096), chunk)
        m = payload_bytes(selected_count(n, chunk, kc), bits_for(min(chunk, n)), value_bits)
        return {"rounds": P - 1, "bytes_received": (P - 1) * m}
