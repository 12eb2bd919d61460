"""``dense``: all-reduce of the whole gradient (the baseline every method is compared with).

Cost (ring): ``2(P-1)`` rounds, ``2(P-1)/P * n`` values each way. No residual; conserving.
"""

from __future__ import annotations

from .base import Reducer
from .registry import register


@register("dense")
class DenseReducer(Reducer):
    def _reduce(self, grad):
        with self.timed("comm"):
            return self.comm.allreduce(grad)
