"""TorchComm: :class:`~sparsync.comm.Comm` over a real ``torch.distributed`` process group.

Every buffer (including size headers) is allocated on ``self.device``: gloo with CPU tensors, gloo
with CUDA tensors (``TorchComm(device="cuda")``: several ranks may share one GPU), or NCCL with CUDA
tensors (one GPU per rank: NCCL refuses two ranks on one device).

Gloo and CUDA tensors (as of torch 2.11):
its collectives take CUDA tensors (all-reduce, all-gather, all-gather into one tensor, broadcast,
all-to-all, sparse all-reduce, barrier: they copy through the host themselves), but point-to-point
``send`` / ``recv`` hand the device pointer to the socket (``writev``: "Bad address", and the rank
aborts). :meth:`TorchComm._post` therefore *stages* them: sends are copied to the host, receives
land in host buffers and ``wait()`` returns them on ``self.device``. Same bits; the copies add a
little PCIe time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import Comm, Handle

__all__ = ["TorchComm", "as_comm"]

# torch >= 2.10 names it all_gather_single (all_gather_into_tensor is deprecated there)
_allgather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
#: pieces of a copy-then-all-reduce (``TorchComm._allreduce_into``; 2, 4 and 8 pieces run alike), and
#: the smallest tensor that is cut (1 Mi elements: below it the copy is short and each extra
#: all-reduce costs its ring's latency)
COPY_PIPELINE, COPY_PIPELINE_MIN = 4, 1 << 20
#: the largest message (bytes) an equal-size all-gather on CPU with ``P >= 3`` sends directly to every
#: peer at once instead of around gloo's ring (``TorchComm._allgather_equal``): latency-bound small
#: messages gain (one batch instead of ``P - 1`` dependent ring steps), large ones lose (the ``P - 1``
#: simultaneous flows queue at the sender's link); ``sparsync bench gather-routes`` measures where the
#: two cross on a given network. At P = 2 the ring is one exchange too, so the collective stays.
DIRECT_GATHER_MAX = 128 * 1024


def as_comm(comm, module: torch.nn.Module | None = None) -> Comm:
    """``comm`` if it is a :class:`~sparsync.comm.Comm`, else a :class:`TorchComm` over that process group
    (None: the default one): what ``SparseDDP``, ``DiLoCo`` and the DDP comm hook accept as their group.
    With ``module`` whose parameters all lie on one accelerator the ``TorchComm`` works on that device
    (gloo carries CUDA tensors, point-to-point messages staged through host memory: module docstring);
    otherwise on the backend's default device."""
    if isinstance(comm, Comm):
        return comm
    devs = {p.device for p in module.parameters()} if module is not None else set()
    device = next(iter(devs)) if len(devs) == 1 and next(iter(devs)).type != "cpu" else None
    return TorchComm(group=comm, device=device)


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor travels as its real view (what ``isend`` / ``irecv`` do)."""
    return torch.view_as_real(t) if t.is_complex() else t


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
        # where point-to-point messages travel: the host for gloo with CUDA tensors (module docstring)
        gloo_cuda = self.device.type != "cpu" and dist.get_backend(group) == "gloo"
        self._wire = torch.device("cpu") if gloo_cuda else self.device
        self._direct_pg = self._process_group()

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _process_group(self):
        """The group object whose ``send`` / ``recv`` :meth:`_post` calls directly, or None where
        ``batch_isend_irecv`` must be used (a backend that coalesces, e.g. NCCL); resolved once, in
        ``__init__``."""
        try:  # torch internals: anything unexpected keeps the public batch_isend_irecv
            pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
            if type(pg) is not dist.ProcessGroup or pg._get_backend(self._wire).supports_coalescing:
                return None
            return pg
        except (AttributeError, RuntimeError):
            return None

    def _post(self, sends, recvs) -> list[Handle]:
        """Post every send, then every receive, at once. Where the backend does not coalesce
        point-to-point operations (gloo), ``batch_isend_irecv`` posts them one by one through
        ``isend`` / ``irecv``, whose argument handling (group lookups, rank translation, checks)
        costs CPU time per message, and a sparse reducer sends dozens per step: the process group's
        own ``send`` / ``recv`` post the same operations, in the same order, directly (group ranks,
        tag 0). Coalescing backends (NCCL) keep ``batch_isend_irecv``. Gloo with CUDA tensors: staged
        through the host (module docstring); a receive's ``wait`` returns it on ``self.device``."""
        if self._wire != self.device:
            sends = [(d, t.to(self._wire)) for d, t in sends]
        bufs = [torch.empty(n, dtype=dt, device=self._wire) for _, n, dt in recvs]
        pg = self._direct_pg
        if pg is not None:
            send_works = [pg.send([_real(t)], d, 0) for d, t in sends]
            recv_works = [pg.recv([_real(b)], s, 0) for (s, _, _), b in zip(recvs, bufs)]
        else:
            ops = [dist.P2POp(dist.isend, t, self._global(d), self.group) for d, t in sends]
            ops += [dist.P2POp(dist.irecv, b, self._global(s), self.group) for (s, _, _), b in zip(recvs, bufs)]
            works = dist.batch_isend_irecv(ops) if ops else []
            send_works, recv_works = works[: len(sends)], works[len(sends):]

        def make(i):
            def wait():
                recv_works[i].wait()
                if i == len(recv_works) - 1:  # sends of the batch are done by the last wait at the latest
                    for w in send_works:
                        w.wait()
                return bufs[i].to(self.device)
            return wait

        if not recvs:
            for w in send_works:
                w.wait()
        return [Handle(make(i)) for i in range(len(recvs))]

    def _split(self, groups):
        """One ``dist.new_group`` per group, every rank creating every group in the same order (gloo
        and NCCL need the whole world in each call); keeps this rank's."""
        if self.world_size != dist.get_world_size():
            raise NotImplementedError("split of a TorchComm over a sub-group of the world: create the groups "
                                      "with dist.new_group yourself and wrap them in TorchComm")
        backend = dist.get_backend(self.group)
        mine = None
        for g in groups:
            pg = dist.new_group([self._global(r) for r in g], backend=backend)
            if self.rank in g:
                mine = pg
        return TorchComm(mine, device=self.device)

    def _allgather(self, t):
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return out

    def _allgather_equal(self, t):
        """Small equal-size gathers on CPU with ``P >= 3`` (counts, padded lists of at most
        :data:`DIRECT_GATHER_MAX` bytes) go as one batch of direct messages: latency-bound, they
        wait for one batch instead of ``P - 1`` ring steps, each of which needs the next process
        scheduled on an oversubscribed host. Larger ones, and CUDA tensors, use the collective."""
        if self.world_size > 2 and self.device.type == "cpu" and t.numel() * t.element_size() <= DIRECT_GATHER_MAX:
            return self._allgather_direct(t)
        return self._allgather(t)

    def _allgather_equal_into(self, t, out):
        """Flat form of :meth:`_allgather_equal`: small gathers by direct messages, the rest by one
        ``all_gather_into_tensor`` straight into ``out``."""
        if self.world_size > 2 and self.device.type == "cpu" and t.numel() * t.element_size() <= DIRECT_GATHER_MAX:
            return super()._allgather_equal_into(t, out)
        self._allgather_into(t, out)

    def _allreduce_(self, t, op):
        dist.all_reduce(t, op=_OPS[op], group=self.group)

    def _allreduce_into(self, t, out, op):
        """Copy and reduce in :data:`COPY_PIPELINE` pieces: each piece's all-reduce is posted
        (``async_op``) as soon as it is copied, so the copy of the next piece runs while gloo moves the
        previous one - the copy a caller that keeps its input pays is hidden behind the wire but for
        its first piece. Every piece is an ordinary all-reduce, so every rank gets the same bits
        (they may differ in the last place from one all-reduce of the whole tensor: the order in
        which gloo adds the ``P`` contributions can depend on where an element lies in the buffer).
        CPU tensors of at least
        ``COPY_PIPELINE_MIN`` elements only (on CUDA the copy is a fraction of a millisecond). The
        ledger records one all-reduce (:meth:`Comm.allreduce`): the same bytes; the pieces' rounds
        overlap, so they are not counted again."""
        if t.device.type != "cpu" or t.numel() < COPY_PIPELINE_MIN:
            return super()._allreduce_into(t, out, op)
        self._post_pieces(out, op, copy_from=t)

    def _allreduce_pieces_(self, t, op):
        """In place, as :data:`COPY_PIPELINE` all-reduces posted at once (CPU tensors of at least
        ``COPY_PIPELINE_MIN`` elements; one all-reduce otherwise): what the dense reducer runs after
        its checked copy (as fast as one all-reduce of the whole buffer, or slightly faster)."""
        if t.device.type != "cpu" or t.numel() < COPY_PIPELINE_MIN:
            return self._allreduce_(t, op)
        self._post_pieces(t, op)

    def _post_pieces(self, out, op, copy_from=None):
        for w in self._piece_works(out, op, copy_from):
            w.wait()

    def _piece_works(self, out, op, copy_from=None) -> list:
        """Post :data:`COPY_PIPELINE` all-reduces of ``out``'s pieces (each piece copied from
        ``copy_from`` first when given); their works, not waited for."""
        n = out.numel()
        bounds = [n * i // COPY_PIPELINE for i in range(COPY_PIPELINE + 1)]
        works = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            if copy_from is not None:
                out[s:e].copy_(copy_from[s:e])
            works.append(dist.all_reduce(out[s:e], op=_OPS[op], group=self.group, async_op=True))
        return works

    def _allreduce_async(self, t, out, op, pieces):
        """The all-reduce of :meth:`Comm.allreduce_async`, posted ``async_op`` on this group in the
        pieces :meth:`Comm.allreduce` uses for the same arguments (so the same bits); the future is
        the works' futures chained with ``then``, as torch's ``allreduce_hook`` does. Its value is
        ``out``; a failed piece sets its error."""
        if t.device.type == "cpu" and t.numel() >= COPY_PIPELINE_MIN and (pieces or out is not t):
            works = self._piece_works(out, op, copy_from=None if out is t else t)
        else:
            if out is not t:
                out.copy_(t)
            works = [dist.all_reduce(out, op=_OPS[op], group=self.group, async_op=True)]
        futs = [w.get_future() for w in works]

        def done(f):
            for x in (f.value() if len(futs) > 1 else [f]):
                x.value()  # raises a piece's error
            return out

        return (futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)).then(done)

    def _allgather_into(self, t, out):
        _allgather_single(out, t, group=self.group)

    def _allgather_into_async(self, t, out):
        work = _allgather_single(out, t, group=self.group, async_op=True)
        return work.get_future().then(lambda f: (f.value(), out)[1])  # (value() raises the gather's error)

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
