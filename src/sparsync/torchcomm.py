"""TorchComm: :class:`~sparsync.comm.Comm` over a real ``torch.distributed`` process group.

Gloo on CPU today; nothing here assumes CPU: every buffer (including size headers) is allocated
on ``self.device``, so an NCCL group with CUDA tensors works the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import Comm, Handle

__all__ = ["TorchComm"]

# torch >= 2.10 names it all_gather_single (all_gather_into_tensor is deprecated there)
_allgather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchComm(Comm):
    """Wraps a process group (the default group when ``group`` is None)."""

    def __init__(self, group=None, device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("TorchComm needs torch.distributed to be initialised (init_process_group)")
        self.group = group
        if device is None:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            if device == "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(dist.get_rank(group), dist.get_world_size(group), device)

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _post(self, sends, recvs) -> list[Handle]:
        ops = [dist.P2POp(dist.isend, t, self._global(d), self.group) for d, t in sends]
        bufs = [torch.empty(n, dtype=dt, device=self.device) for _, n, dt in recvs]
        ops += [dist.P2POp(dist.irecv, b, self._global(s), self.group) for (s, _, _), b in zip(recvs, bufs)]
        works = dist.batch_isend_irecv(ops) if ops else []
        send_works, recv_works = works[: len(sends)], works[len(sends):]

        def make(i):
            def wait():
                recv_works[i].wait()
                if i == len(recv_works) - 1:  # sends of the batch are done by the last wait at the latest
                    for w in send_works:
                        w.wait()
                return bufs[i]
            return wait

        if not recvs:
            for w in send_works:
                w.wait()
        return [Handle(make(i)) for i in range(len(recvs))]

    def _allgather(self, t):
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return out

    def _allreduce_(self, t, op):
        dist.all_reduce(t, op=_OPS[op], group=self.group)

    def _allgather_into(self, t, out):
        _allgather_single(out, t, group=self.group)

    def _alltoall(self, flat, send_splits, recv_splits):
        out = torch.empty(sum(recv_splits), dtype=flat.dtype, device=self.device)
        dist.all_to_all_single(out, flat, recv_splits, send_splits, group=self.group)
        return out

    def _broadcast(self, t, src):
        out = t.clone()
        dist.broadcast(out, self._global(src), group=self.group)
        return out

    def _sparse_allreduce(self, indices, values, numel):
        t = torch.sparse_coo_tensor(indices.unsqueeze(0), values, (numel,), check_invariants=False)
        dist.all_reduce(t, group=self.group)
        t = t.coalesce()
        return t.indices()[0], t.values()

    def _barrier(self):
        dist.barrier(group=self.group)
