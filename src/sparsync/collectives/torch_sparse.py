"""Baseline: torch's own sparse COO ``all_reduce`` (gloo supports sparse tensors).

Gloo's sparse all-reduce all-gathers the index and value tensors of every rank and sums them
(the S2 Reducer paper's "PyTorch sparse AllGather"). Only available on a real process group
(TorchComm); on the thread backend the same computation is emulated with ``allgatherv`` so the
tests and simulations can still use the name. Ledger: recorded as two variable all-gathers
(indices as int64 and values), ring model: ``rounds = 2(P-1)``, ``bytes_received = (P-1)*k*(8+isize)``.

On a real group the ledger needs every rank's count, which torch's (coalesced) result does not
reveal, so one small unrecorded all-gather of counts runs first; it is part of this baseline's
measured time (one latency-bound collective, ~0.1 ms on loopback, ~1 ms on the emulated links).
"""

from __future__ import annotations

import torch

from ..sparse import SparseVec
from .allgather import sum_in_rank_order
from .registry import register


def _record_as_allgathers(comm, sv: SparseVec) -> None:
    from ..comm import PhaseCost

    P = comm.world_size
    k = torch.tensor([sv.nnz], dtype=torch.int64)
    with comm.unrecorded():
        counts = [int(c[0]) for c in comm.allgather(k)]
    m = max(counts)
    nb = (P - 1) * m * (8 + sv.values.element_size())
    cost = PhaseCost(2 * (P - 1), 2 * (P - 1), nb, nb, 2 * (P - 1), P - 1, 8 * (P - 1))
    comm._record(cost)


@register("torch_sparse")
def torch_sparse(sv: SparseVec, comm, **_) -> torch.Tensor:
    from ..torchcomm import TorchComm

    if isinstance(comm, TorchComm):
        import torch.distributed as dist

        _record_as_allgathers(comm, sv)
        t = torch.sparse_coo_tensor(sv.indices.unsqueeze(0), sv.values, (sv.numel,), check_invariants=False)
        dist.all_reduce(t, group=comm.group)
        t = t.coalesce()
        out = torch.zeros(sv.numel, dtype=sv.dtype, device=sv.device)
        out[t.indices()[0]] = t.values()
        return out
    idx = comm.allgatherv(sv.indices)
    vals = comm.allgatherv(sv.values)
    payloads = [SparseVec(i, v, sv.numel, check=False) for i, v in zip(idx, vals)]
    return sum_in_rank_order(payloads, sv.numel, sv.dtype, sv.device)
