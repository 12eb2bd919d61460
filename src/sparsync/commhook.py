"""The torch DDP comm hook: a sparsync reducer on ``DistributedDataParallel``'s buckets.

``model.register_comm_hook(None, ss.ddp_hook("micro", density=0.01, module=model))`` - see
:class:`DDPHook` for the contract (futures chained with ``then``: a one-collective reducer posted
``async_op``, the others on a FIFO communication thread; its own process group; per-parameter
residuals across DDP's bucket rebuild; per-rank state and its gathered form for single-writer
checkpoints). Also importable as ``sparsync.ddp_hook`` / ``sparsync.DDPHook`` / ``sparsync.ddp.*``.

This module decides which reducers run on the hook's futures: only those that declare ``staged``
(one collective per step), because a sparse reducer's later collectives depend on its earlier ones,
and chained with ``then`` (as torch's PowerSGD hook chains its two all-reduces) they would be posted
from the backend's completion thread while the autograd thread posts the next bucket's first one,
in an order that differs between ranks, which gloo (pairing collectives by issue order) turns into
a deadlock or wrong sums.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import rankstate
from .comm import Comm
from .schedule.worker import CommWorker
from .torchcomm import as_comm

__all__ = ["DDPHook", "ddp_hook"]


class DDPHook:
    """Comm hook for ``torch.nn.parallel.DistributedDataParallel`` running a sparsync reducer per bucket.

    ``model.register_comm_hook(state, ss.ddp_hook("topka", density=0.01))``: ``state`` may be None
    or the DDP model itself (then the hook reduces on **its own process group**: a new group with
    the ranks and backend of DDP's, created in the hook's first call - on every rank the first
    bucket of the first backward - never on DDP's group), a sparsync ``Comm`` or a process group
    (used as given: it must carry nothing else during backward). One reducer per bucket index
    (``bucket.index()``).

    **Asynchronous** (default), like torch's ``allreduce_hook`` / ``powerSGD_hook``: the hook
    returns at once a ``torch.futures.Future``, chained with ``then`` on the bucket's reduction, whose
    callback writes ``sum / P`` into the bucket (one pass) and returns it; an error (bad input, a
    failed or timed-out collective) is the future's exception, which DDP raises from ``backward``.
    DDP keeps computing backward and launching later buckets meanwhile. Two paths, by what the
    reducer declares (:attr:`~sparsync.reducers.base.Reducer.staged`):

    * a **staged** reducer (one collective per step: ``dense``'s all-reduce, ``sparseloco``'s all-gather)
      does its local work in the hook call and posts its collective ``async_op=True`` on the hook's group
      (:meth:`~sparsync.reducers.base.Reducer.start`, :meth:`~sparsync.comm.Comm.allreduce_async` /
      :meth:`~sparsync.comm.Comm.allgather_into_async`): the future is the work's future chained with
      ``then``, no thread involved;
    * every other reducer makes several collectives, each depending on the one before (calibration,
      index all-gather, value exchange). Posted from completion callbacks, one bucket's later stages
      could be issued before or after another bucket's on different ranks, and gloo pairs collectives
      by their order of issue on a group. Its whole reduction therefore runs on one FIFO
      communication thread per hook, which completes the future that the ``then`` above chains.

    DDP calls the hook for its buckets in index order on every rank; the staged path issues its
    collective in that call and the FIFO thread keeps that order, so every rank issues identical
    collectives in identical order: the result is bitwise identical across ranks, and bitwise equal
    to ``asynchronous=False`` (the reduction inside the hook call), with the same ledger. The group
    is the hook's own because DDP itself issues collectives on its group while the hook's
    collectives are in flight: with ``find_unused_parameters=True`` (the HF Trainer's default for a
    ``PreTrainedModel``) it all-reduces the used-parameter map once the last bucket is launched, and
    two threads issuing collectives on one group in a different order on different ranks deadlock.

    **State**: ``hook.state_dict()`` is tensors and plain data (no process group, worker thread or
    module): ``torch.save(hook.state_dict(), f)``, then ``hook.load_state_dict(torch.load(f,
    weights_only=True))`` on a fresh hook - ``weights_only=True``, so a crafted file cannot run code -
    and register it again (``model.register_comm_hook(model, hook)`` gives it the module for the
    per-parameter layout). ``torch.save(hook, f)`` also works, like PowerSGD's state, but loading a
    pickled object means full unpickling (``weights_only`` off): only for files you trust.
    The state is **per rank** (residuals: what this rank has not sent yet) and records ``rank`` and
    ``world_size``; loading another rank's state raises ``ValueError`` (another world size: a
    warning). For a checkpoint that one rank writes, ``hook.gathered_state_dict()`` (a collective)
    returns every rank's state in one object, and ``load_state_dict`` of that object takes this
    rank's entry (:mod:`sparsync.rankstate`). A state loaded before the process group exists
    (unpickling) is matched to its rank in the hook's first call.

    DDP lays its buckets out in one order in the first iteration and rebuilds them in gradient-ready
    order after it, so a bucket's contents can move. The hook therefore needs to know the model's
    parameters to keep residuals right across a rebuild or a resume: pass ``module=`` to
    :func:`ddp_hook` (or the DDP model as ``state``). It then records each bucket's layout (parameter
    indices of ``module.parameters()``), and ``state_dict()`` stores residuals **per parameter**; a
    reducer created for a new layout gets its residual re-assembled from those pieces (other reducer
    state is kept only when the layout is unchanged). After a load, a bucket tiled exactly by saved
    buckets (DDP's first iteration, before its rebuild) is reduced part by part with the saved
    reducers, so a resume is bitwise. Without a module, a bucket whose size changes
    gets a fresh reducer and a loaded state is used only for a bucket of the same size - correct only
    if the layout did not change (a warning says so).
    """

    def __init__(self, reducer: str, density: float = 0.01, module=None, asynchronous: bool = True, **options):
        from .reducers.registry import load_all

        if reducer not in load_all():
            raise ValueError(f"unknown reducer {reducer!r}; valid: {', '.join(sorted(load_all()))}")
        self.reducer_name = reducer
        self.__name__ = self.__qualname__ = f"sparsync_{reducer}_hook"  # torch DDP reads these
        self.density = density
        self.options = options
        self.asynchronous = bool(asynchronous)
        self._staged = bool(load_all().lookup(reducer).staged)
        self.comm = None
        self.module = module
        self._pindex = None
        self._worker = None
        self.reducers: dict[int, object] = {}
        self.layouts: dict[int, list | None] = {}
        self._pending: dict | None = None
        self._loaded = None
        self.last_stats: dict = {}

    def __getstate__(self):
        return {"reducer": self.reducer_name, "density": self.density, "options": dict(self.options),
                "asynchronous": self.asynchronous, "state": self.state_dict()}

    def __setstate__(self, d):
        self.__init__(d["reducer"], d["density"], asynchronous=d.get("asynchronous", True), **d["options"])
        self.load_state_dict(d["state"])

    def close(self) -> None:
        """Stop the communication thread, if any (a later call starts a new one)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _comm_for(self, state):
        if self.comm is None:
            if isinstance(state, nn.Module):
                if self.module is None:
                    self.module = state
                state = own_group(getattr(state, "process_group", None))
            elif state is None or state is getattr(self.module, "process_group", None):
                state = own_group(state)
            self.comm = state if isinstance(state, Comm) else as_comm(state, self.module)
            if self._loaded is not None:  # loaded before the rank was known (unpickled)
                self._load_own(self._loaded)
        return self.comm

    def _rank(self):
        """(rank, world_size) of this hook's group, or of the default group before its first call."""
        if self.comm is not None:
            return self.comm.rank, self.comm.world_size
        import torch.distributed as dist

        group = getattr(self.module, "process_group", None)
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(group), dist.get_world_size(group)
        return None, None

    def _layout(self, bucket):
        if self.module is None:
            return None
        if self._pindex is None:
            self._pindex = {id(p): i for i, p in enumerate(self.module.parameters())}
        try:
            return [self._pindex[id(p)] for p in bucket.parameters()]
        except KeyError:
            return None

    def _new_reducer(self, idx, numel, layout):
        from .reducers.registry import make_reducer

        r = make_reducer(self.reducer_name, self.comm, self.density, **self.options)
        pend = self._pending
        if pend is None:
            return r
        saved = pend["buckets"].get(idx)
        if saved is not None and saved.get("layout") == layout and saved["state"].get("numel") in (None, numel):
            if layout is None:
                warnings.warn("sparsync ddp_hook: loading bucket state without a module; correct only if DDP's "
                              "bucket layout is unchanged (pass module= to ddp_hook)", stacklevel=3)
            r.load_state_dict(saved["state"])
        elif layout is not None and pend.get("per_param"):
            pieces = pend["per_param"]
            if all(i in pieces for i in layout):
                r.residual = torch.cat([pieces[i].reshape(-1) for i in layout]).to(self.comm.device)
                r.numel = r.residual.numel()
            r.step = int(pend.get("step", 0))
        return r

    def __call__(self, state, bucket):
        comm = self._comm_for(state)
        try:
            sums = self._post(comm, bucket)
        except BaseException as e:  # noqa: BLE001 - DDP re-raises it when it waits on the future
            sums = torch.futures.Future()
            sums.set_exception(e)
        buf = bucket.buffer()

        def write(f):  # bucket := sum over ranks / P, one pass (an error of f re-raises here)
            torch.div(f.value().reshape(buf.shape), comm.world_size, out=buf)
            return buf

        return sums.then(write)

    def _post(self, comm, bucket) -> torch.futures.Future:
        """Start the bucket's reduction: a future of its sum over ranks (flat). Staged reducer: the
        local work now and the collective posted ``async_op`` (:meth:`Reducer.start`); otherwise the
        whole reduction on the FIFO thread (asynchronous) or now (synchronous)."""
        if self.asynchronous and self._staged:
            idx, layout = int(bucket.index()), self._layout(bucket)
            if self._saved_parts(idx, layout) is None:
                buf = bucket.buffer()
                r = self._reducer(idx, buf.numel(), layout)
                started = r.start(_flat(buf), donate=True)  # the bucket is the hook's to overwrite
                self._finish_bucket(bucket)

                def stats(f):
                    out = f.value()
                    self.last_stats[idx] = dict(r.stats)
                    return out

                return started.then(stats)
        fut = torch.futures.Future()

        def job():
            try:
                fut.set_result(self._sum_bucket(comm, bucket))
            except BaseException as e:  # noqa: BLE001 - re-raised by the hook's future
                fut.set_exception(e)

        if not self.asynchronous or self._staged:  # staged: a resume's first bucket in parts, in order
            job()
        else:
            if self._worker is None:
                self._worker = CommWorker(f"sparsync-hook-rank{comm.rank}")
            self._worker.submit(job)
        return fut

    def _reducer(self, idx, numel, layout):
        """The reducer of bucket ``idx``; a new one when the bucket's layout or size changed."""
        r = self.reducers.get(idx)
        if r is None or self.layouts.get(idx) != layout or (r.numel is not None and r.numel != numel):
            if r is not None and self._pending is None and layout is not None:
                self._pending = self.state_dict()  # carry residuals across DDP's bucket rebuild
            r = self._new_reducer(idx, numel, layout)
            self.reducers[idx] = r
            self.layouts[idx] = layout
        return r

    def _sum_bucket(self, comm, bucket):
        """One bucket's sum over ranks, flat, reduced here and now (blocking collectives)."""
        buf = bucket.buffer()
        idx = int(bucket.index())
        layout = self._layout(bucket)
        parts = self._saved_parts(idx, layout)
        if parts is not None:
            out = self._sum_saved_parts(buf, layout, parts)
        else:
            r = self._reducer(idx, buf.numel(), layout)
            out = r.reduce(_flat(buf), donate=True)  # the bucket: overwritten by the write-back anyway
            self.last_stats[idx] = dict(r.stats)
        self._finish_bucket(bucket)
        return out

    def _finish_bucket(self, bucket):
        if bucket.is_last():
            self._pending = None if all(i in self.reducers for i in (self._pending or {}).get("buckets", {})) \
                else self._pending

    def _saved_parts(self, idx, layout):
        """After a load: the saved buckets that tile this bucket exactly, when this bucket's layout is
        not a saved one (DDP's first iteration after construction has its own layout, before the
        rebuild). Reducing those parts with their saved reducers, in saved index order, is what the
        uninterrupted run did - so a resume is bitwise whatever DDP's initial layout."""
        pend = self._pending
        if pend is None or layout is None:
            return None
        saved = {i: b.get("layout") for i, b in pend["buckets"].items() if b.get("layout") is not None}
        if saved.get(idx) == layout:
            return None
        want = set(layout)
        parts = sorted(i for i, lay in saved.items() if set(lay) <= want)
        if sorted(j for i in parts for j in saved[i]) != sorted(layout):
            return None
        return [(i, saved[i]) for i in parts]

    def _sum_saved_parts(self, buf, layout, parts):
        sizes = self._param_sizes()
        offsets, off = {}, 0
        for j in layout:
            offsets[j] = off
            off += sizes[j]
        flat = buf.reshape(-1)
        sums = torch.empty_like(flat)
        for i, lay in parts:
            index = torch.cat([torch.arange(offsets[j], offsets[j] + sizes[j], device=flat.device) for j in lay])
            r = self._reducer(i, index.numel(), lay)
            sums[index] = r.reduce(_flat(flat[index])).to(sums.dtype)
            self.last_stats[i] = dict(r.stats)
        return sums

    def _param_sizes(self):
        return [p.numel() for p in self.module.parameters()] if self.module is not None else None

    def state_dict(self) -> dict:
        """Reducer state per bucket (+ residual pieces per parameter when the module is known)."""
        buckets = {i: {"state": r.state_dict(), "layout": self.layouts.get(i)} for i, r in self.reducers.items()}
        per_param, step = {}, 0
        sizes = self._param_sizes()
        for i, r in self.reducers.items():
            step = max(step, r.step)
            lay = self.layouts.get(i)
            if lay is not None and r.residual is not None:
                for pi, piece in zip(lay, torch.split(r.residual.detach().cpu(), [sizes[j] for j in lay])):
                    per_param[pi] = piece.clone()
        if self._pending:  # buckets not seen since a load keep their saved state
            for i, b in self._pending["buckets"].items():
                buckets.setdefault(i, b)
            for pi, piece in self._pending.get("per_param", {}).items():
                per_param.setdefault(pi, piece)
        if self._loaded is not None:  # loaded, not matched to a rank yet (no call since unpickling)
            return self._loaded
        state = {"reducer": self.reducer_name, "buckets": buckets, "per_param": per_param, "step": step}
        return rankstate.stamp(state, *self._rank())

    def gathered_state_dict(self) -> dict:
        """Every rank's :meth:`state_dict` in one object (the same on every rank): for a checkpoint
        that one rank writes. A collective over the hook's group (before the hook's first call: DDP's
        group), so every rank must call it, outside backward; ``load_state_dict`` takes the result."""
        comm = self.comm
        if comm is None:
            comm = as_comm(getattr(self.module, "process_group", None))
        return rankstate.gather(self.state_dict(), comm)

    def load_state_dict(self, d: dict) -> None:
        """Load :meth:`state_dict`'s result (this rank's: another rank's raises ``ValueError``) or
        :meth:`gathered_state_dict`'s (this rank's entry is taken)."""
        first = d["states"][0] if rankstate.is_gathered(d) and d["states"] else d
        if not isinstance(first, dict) or first.get("reducer") != self.reducer_name:
            got = first.get("reducer") if isinstance(first, dict) else type(first).__name__
            raise ValueError(f"hook state is for reducer {got!r}, not {self.reducer_name!r}")
        self.reducers = {}
        self.layouts = {}
        rank, _ = self._rank()
        if rank is None:
            self._loaded, self._pending = d, None
        else:
            self._load_own(d)

    def _load_own(self, d: dict) -> None:
        self._loaded = None
        d = rankstate.own(d, *self._rank(), what=f"sparsync ddp_hook({self.reducer_name!r})")
        if d is None:  # a gathered state without this rank (the world grew): start fresh
            self._pending = None
            return
        self._pending = {"buckets": dict(d["buckets"]), "per_param": dict(d.get("per_param") or {}),
                         "step": int(d.get("step", 0))}


def _flat(buf: torch.Tensor) -> torch.Tensor:
    """A bucket as a reducer's input: 1-D, floating point."""
    flat = buf.reshape(-1)
    return flat if flat.dtype.is_floating_point else flat.float()


def own_group(group=None):
    """A new process group with the ranks and backend of ``group`` (None: the default group).
    Every rank of the default group must call it in the same order (every member of ``group`` when
    it is a subgroup)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sparsync ddp_hook: torch.distributed is not initialised (init_process_group first)")
    backend = dist.get_backend(group)
    if group is None or dist.get_world_size(group) == dist.get_world_size():
        return dist.new_group(backend=backend)
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend=backend,
                          use_local_synchronization=True)


def ddp_hook(reducer: str = "dense", density: float = 0.01, module=None, asynchronous: bool = True,
             **options) -> DDPHook:
    """A torch DDP comm hook running ``reducer`` on every bucket (see :class:`DDPHook`).

    ``module``: the DDP model (or its module), so residuals follow parameters across DDP's bucket
    rebuild and across a resume. ``asynchronous=False`` reduces inside the hook call (no overlap;
    the returned future is complete).
    """
    return DDPHook(reducer, density, module=module, asynchronous=asynchronous, **options)
