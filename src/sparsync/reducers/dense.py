"""``dense``: all-reduce of the whole gradient (the baseline every method is compared with).

Cost (ring): ``2(P-1)`` rounds, ``2(P-1)/P * n`` values received per rank. No residual
(``has_memory = False``); conserving.

It costs what ``all_reduce`` costs: the gradient is copied once into a recycled output buffer
(:meth:`~sparsync.reducers.base.Reducer.output_buffer`: no fresh allocation and its page faults per
step) and reduced there in place; the caller's gradient is left untouched. On a real process group
the copy runs in pieces, each piece's all-reduce posted as soon as it is copied
(``TorchComm._allreduce_into``), so it hides behind the wire. With the input check on
(``nonfinite="error"``, the default) the copy and the check are one pass
(:meth:`~sparsync.reducers.base.Reducer.sum_checked`, streaming stores) that must end before
anything is sent, and the buffer is then reduced in place, in the same pieces
(``Comm.allreduce(..., pieces=True)``); with ``nonfinite="ignore"`` the piecewise copy.
A caller that donates its gradient buffer (``reduce(grad, donate=True)``, as ``SparseDDP`` does
with its own buffers; or option ``inplace=True`` for every call) has no copy at all: the gradient
tensor itself is reduced, in the same pieces, and returned - the same bits as the copying path.

``value_dtype="fp16"`` / ``"bf16"``: the values travel and are summed in half precision (half the
bytes), then returned in the gradient's dtype - what torch's ``fp16_compress_hook`` does (no
residual; the rounding is lost, so such an instance reports ``conserving = False``); a donated
gradient buffer receives the half-precision sum (no output buffer).
"""

from __future__ import annotations

import torch

from .base import Reducer
from .registry import register


@register("dense")
class DenseReducer(Reducer):
    has_memory = False  # everything is sent: no residual
    checks_input = True  # in _reduce: fused into the copy, or before the in-place all-reduce
    supports_value_dtype = True  # fp16/bf16: torch's fp16_compress_hook (cast, all-reduce, cast back)
    value_dtype_conserving = False

    def __init__(self, comm, density: float = 0.01, inplace: bool = False, **rest):
        super().__init__(comm, density=density, **rest)
        self.inplace = bool(inplace)

    staged = True  # one all-reduce: :meth:`_start` posts it and returns its future

    def _reduce(self, grad):
        def allreduce(*args, **kwargs):  # the wire time: the all-reduce, not the local passes around it
            with self.timed("comm"):
                return self.comm.allreduce(*args, **kwargs)

        return self._exchange(grad, allreduce)

    def _start(self, grad):
        return self._exchange(grad, self.comm.allreduce_async)

    def _exchange(self, grad, allreduce):
        """The step, with ``allreduce`` = ``Comm.allreduce`` (the sum) or ``Comm.allreduce_async`` (its future)."""
        mine = self.inplace or self.donated  # the caller gave its gradient buffer up: no copy at all
        if self.wire_dtype is not None:  # half precision on the wire and in the sum (fp16_compress_hook)
            self.check_finite(grad)
            out = grad if mine else self.output_buffer(grad.numel(), grad.dtype, grad.device)
            sent = self.wire_values(grad)
            summed = allreduce(sent, out=sent, pieces=True)
            if not isinstance(summed, torch.Tensor):  # start()'s future: back to the gradient's dtype when done
                return summed.then(lambda f: out.copy_(f.value()))
            return out.copy_(summed)
        if mine:
            self.check_finite(grad)
            return allreduce(grad, out=grad, pieces=True)
        out = self.output_buffer(grad.numel(), grad.dtype, grad.device)
        if self.nonfinite == "ignore":  # nothing to check: the copy runs in pieces behind the wire
            return allreduce(grad, out=out)
        # the check must see all of grad before anything is sent: copy and check in one pass,
        # then reduce in place (one pass where the copy behind the wire needed a check pass too)
        self.sum_checked(out, grad, None)
        return allreduce(out, out=out, pieces=True)

    @classmethod
    def predicted_cost(cls, P, n, k=None, value_bytes=4, index_bytes=4, **_):
        """Ring all-reduce: ``2(P-1)`` rounds, ``2(P-1)/P * n * value_bytes`` received per rank
        (``value_bytes=2`` for ``value_dtype`` fp16/bf16)."""
        return {"rounds": 2 * (P - 1), "bytes_received": 2 * (P - 1) * n * value_bytes // P if P > 1 else 0}
