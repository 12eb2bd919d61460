"""``ps``: local top-k with error feedback, summed through a synchronous sharded parameter server.

The thesis' parameter-server baseline (Renggli et al., "SparCML", SC 2019) as a reducer: ``acc = grad + residual``,
send the ``k`` largest ``|acc|``, keep the rest as residual (conserving), and sum through
:func:`sparsync.ps.ps_allreduce` with ``servers`` server ranks (default 1) instead of a collective.
The result is bitwise identical on every rank (servers sum in rank order, everyone pulls the same
bytes).
"""

from __future__ import annotations

from ..ps import check_servers, ps_allreduce
from ..select.topk import topk_abs
from ..sparse import SparseVec, as_dense
from .base import Reducer
from .registry import register


@register("ps")
class ParameterServerReducer(Reducer):
    def __init__(self, comm, density: float = 0.01, servers: int = 1, **rest):
        super().__init__(comm, density=density, **rest)
        self.servers = check_servers(servers, comm.world_size)

    def _reduce(self, grad):
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx, vals = topk_abs(acc, self.k)
            self.memory.keep(acc, idx)
        self.stats["selected"] = idx.numel()
        with self.timed("comm"):
            out = ps_allreduce(SparseVec(idx, vals, self.numel, check=False), self.comm, servers=self.servers)
        return as_dense(out)
