"""``dense``: all-reduce of the whole gradient (the baseline every method is compared with).

Cost (ring): ``2(P-1)`` rounds, ``2(P-1)/P * n`` values received per rank. No residual; conserving.

It costs what ``all_reduce`` costs: the gradient is copied once into a recycled output buffer
(:meth:`~sparsync.reducers.base.Reducer.output_buffer`: no fresh 40 MB allocation and its page
faults per step, which is what made this reducer ~16% slower than a bare gloo ``all_reduce``) and
reduced there in place; the caller's gradient is left untouched. That copy is the whole
difference to a bare in-place ``all_reduce`` (~4 % at n = 1e7 on the emulated 1 Gbit/s links);
on a real process group it runs in pieces, each piece's all-reduce posted as soon as it is copied
(``TorchComm._allreduce_into``), so it hides behind the wire (``docs/benchmarks.md``, issue 11).
Option ``inplace=True`` removes the copy for a caller that donates its gradient buffer (like torch
DDP's buckets): the gradient tensor itself is reduced and returned.
"""

from __future__ import annotations

from .base import Reducer
from .registry import register


@register("dense")
class DenseReducer(Reducer):
    def __init__(self, comm, density: float = 0.01, inplace: bool = False, **rest):
        super().__init__(comm, density=density, **rest)
        self.inplace = bool(inplace)

    def _reduce(self, grad):
        with self.timed("comm"):
            if self.inplace:  # the caller donates its gradient buffer: no copy at all
                return self.comm.allreduce(grad, out=grad)
            out = self.output_buffer(grad.numel(), grad.dtype, grad.device)
            return self.comm.allreduce(grad, out=out)

    @classmethod
    def predicted_cost(cls, P, n, k=None, value_bytes=4, index_bytes=4, **_):
        return {"rounds": 2 * (P - 1), "bytes_received": 2 * (P - 1) * n * value_bytes // P if P > 1 else 0}
