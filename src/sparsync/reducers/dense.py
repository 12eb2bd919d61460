"""``dense``: all-reduce of the whole gradient (the baseline every method is compared with).

Cost (ring): ``2(P-1)`` rounds, ``2(P-1)/P * n`` values received per rank. No residual; conserving.
"""

from __future__ import annotations

from .base import Reducer
from .registry import register


@register("dense")
class DenseReducer(Reducer):
    def _reduce(self, grad):
        with self.timed("comm"):
            return self.comm.allreduce(grad)

    @classmethod
    def predicted_cost(cls, P, n, k=None, value_bytes=4, index_bytes=4, **_):
        return {"rounds": 2 * (P - 1), "bytes_received": 2 * (P - 1) * n * value_bytes // P if P > 1 else 0}
