"""Baseline: torch's own sparse COO ``all_reduce`` (gloo supports sparse tensors).

Gloo's sparse all-reduce all-gathers the index and value tensors of every rank and sums them
(the S2 Reducer paper's "PyTorch sparse AllGather"). It is a capability of the comm,
:meth:`sparsync.comm.Comm.sparse_allreduce_coo`: a real process group runs torch's own
``all_reduce`` of a sparse COO tensor, the thread backend the same computation (gather, coalesce in
rank order). Ledger (recorded by the comm): two variable all-gathers (indices as int64 and values),
ring model: ``rounds = 2(P-1)``, ``bytes_received = (P-1)*k*(8+isize)``; the count exchange it needs
for that is part of this baseline's measured time (one latency-bound collective).
"""

from __future__ import annotations

import torch

from ..sparse import SparseVec
from .registry import register


@register("torch_sparse")
def torch_sparse(sv: SparseVec, comm, **_) -> torch.Tensor:
    idx, vals = comm.sparse_allreduce_coo(sv.indices, sv.values, sv.numel)
    out = torch.zeros(sv.numel, dtype=sv.dtype, device=sv.device)
    out[idx] = vals
    return out
