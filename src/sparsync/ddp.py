"""SparseDDP — a drop-in for ``DistributedDataParallel`` whose gradient exchange is a sparsync reducer.

::

    ddp = ss.SparseDDP(model, comm, reducer="spardl", density=0.01, merge="mgwfbp",
                       reducer_options={...}, timeline="trace.json")
    loss = loss_fn(ddp(x), y); loss.backward()   # .grad = average over ranks (sum / P)
    opt.step(); ddp.last_stats                   # select_s, comm_s, wait_s, bytes, density, groups, ...

What it does (wait-free backpropagation with merged gradients: Shi et al., "MG-WFBP", INFOCOM 2019):

* at construction: checks that every rank has the same trainable parameters (count, shapes, dtypes;
  a clear ``ValueError`` naming the first difference otherwise), broadcasts parameters and buffers
  from rank 0;
* during backward: gradients are grouped by the merge plan (``wfbp``, ``single``,
  ``buckets:<MB>``, ``mgwfbp``, ``optimal``; see :mod:`sparsync.schedule.merge`), one reducer
  (``ss.make_reducer``) per group, reduced on a communication thread while backward continues
  (:mod:`sparsync.schedule.engine`);
* when ``loss.backward()`` returns, every ``param.grad`` holds ``sum over ranks / P`` of what the
  reducers transmitted — bitwise identical on every rank, so parameters stay identical;
* ``state_dict()`` / ``load_state_dict()``: a well-behaved ``nn.Module`` - the model's tensors under
  ``module.*`` like torch DDP (``_orig_mod.module.*`` under ``torch.compile``), and the engine state
  (the plan, every reducer's residuals / counters / own state, the policy's state; no process group)
  as this module's extra state ``_extra_state`` (``sparsync_state_dict()`` alone), so a resumed run
  continues bitwise identically;
* sparse gradients (``nn.Embedding(sparse=True)``) are densified into their group, or — when the
  reducer has a ``reduce_sparse(coo)`` method — sent alone through it.

The adapter that puts a sparsync reducer on torch DDP's buckets, :func:`ddp_hook` / :class:`DDPHook`,
lives in :mod:`sparsync.commhook` and is importable from here too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import rankstate
from .commhook import DDPHook, ddp_hook
from .schedule.engine import OverlapEngine
from .torchcomm import as_comm

__all__ = ["DDPHook", "SparseDDP", "agree_steps", "ddp_hook"]


class SparseDDP(nn.Module):
    """Wrap ``module`` for data-parallel training over the sparsync ``comm``.

    Args:
        module: the model (identical architecture on every rank).
        comm: a :class:`sparsync.Comm` (``TorchComm`` or ``ThreadComm``), or a torch process group
            (wrapped in a ``TorchComm``), or None for the default process group. ``process_group=``
            is accepted as a synonym (torch DDP's name).
        reducer: registered reducer name (``dense``, ``topka``, ...; see ``ss.make_reducer``).
        density: fraction of entries each reducer may send.
        merge: ``"wfbp"``, ``"single"``, ``"buckets:<MB>"``, ``"mgwfbp"`` or ``"optimal"``; default
            ``"single"``, or ``"buckets:<bucket_cap_mb>"`` when ``bucket_cap_mb`` is given.
        reducer_options: extra keyword options for the reducer.
        policy: a convergence policy (``sparsync.convergence.GradientPolicy`` or any object with its
            methods): ``density(step, target)`` sets every reducer's density before a step,
            ``before_reduce(group, grad, reducer)`` / ``after_reduce(group, reducer)`` run around each
            group's reduce on the communication thread; its ``state_dict()`` is part of the sparsync
            state (bitwise resume). Not applied to the sparse path (``reduce_sparse``).
        nonfinite: ``"error"`` (default: a NaN/Inf gradient raises ``FloatingPointError`` on the
            rank that saw it, with no extra collective; the launcher stops the others), ``"skip"``
            (one small flag all-gather per step; every rank drops the step: ``.grad`` set to None),
            ``"ignore"`` (no check).
        unused: ``"zero"`` (default: parameters without a gradient contribute zeros, like
            ``find_unused_parameters=True``) or ``"error"`` (raise on every rank).
        broadcast_buffers: keep rank 0's buffers on every rank (like DDP); default True. Buffers are
            broadcast at construction and at the end of every synchronised backward (so the next
            forward sees rank 0's buffers, as with DDP's broadcast before forward, and the forward
            stays free of collectives under ``torch.compile``).
        profile_warmup, profile_steps: steps before / of profiling for ``mgwfbp``/``optimal``.
        cost_model: ``(a, b)`` seconds and seconds per byte, or a ``CostModel``; skips the fit.
        profile: a ``BackwardProfile`` / ``{"order", "t_b"}``; with ``cost_model`` skips profiling.
        timeline: path of a Chrome-trace JSON per rank (``{rank}`` or ``.rank<r>`` is inserted).
        delay: 0 (default) - ``.grad`` holds this step's average when ``backward()`` returns; 1 -
            *delayed averaging*: it holds the previous step's average (nothing at the first step:
            ``.grad`` is None there, so ``optimizer.step()`` skips it), and this step's reduce runs
            on the communication thread during the next step's optimizer, forward and backward, so
            the step does not wait for the network (Pipe-SGD, Li et al., NeurIPS 2018, pipeline
            width 2; Delayed Gradient Averaging, Zhu et al., NeurIPS 2021). Parameters stay
            identical on every rank; the update uses a one-step-stale gradient. ``flush()`` applies
            the step still in flight; ``state_dict()`` holds it (bitwise resume). Needs a merge plan
            that is final from the start. See docs/engine.md, "Delayed averaging".

    torch DDP's arguments (see ``docs/engine.md``, "torch DDP arguments"): ``device_ids`` and
    ``output_device`` (None, or the single device the module lives on; the module is not moved),
    ``find_unused_parameters`` (either value: unused parameters always contribute zeros, at no
    cost - no graph traversal), ``gradient_as_bucket_view`` (default True here: ``.grad`` are views
    into the per-group flat buffers; False gives each step fresh gradient tensors),
    ``static_graph`` (accepted, nothing to do: the engine needs no graph analysis),
    ``bucket_cap_mb`` (the ``buckets:<MB>`` plan), ``init_sync`` (False skips the broadcast at
    construction), ``dim`` (0 only). Anything else DDP takes (``mixed_precision``,
    ``device_mesh``, ...) raises ``TypeError``.
    """

    def __init__(self, module: nn.Module, comm=None, reducer: str = "dense", density: float = 0.01,
                 merge: str | None = None, reducer_options: dict | None = None, *, policy=None,
                 nonfinite: str = "error", unused: str = "zero", broadcast_buffers: bool = True,
                 profile_warmup: int = 2, profile_steps: int = 5, cost_model=None, profile=None,
                 timeline: str | None = None, timeline_steps: int = 50, cost_max_bytes: int = 64 << 20,
                 process_group=None, device_ids=None, output_device=None, dim: int = 0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True,
                 static_graph: bool = False, bucket_cap_mb: float | None = None, init_sync: bool = True,
                 delay: int = 0, **ddp_kwargs):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"SparseDDP wraps an nn.Module, got {type(module).__name__}")
        if ddp_kwargs:
            raise TypeError(f"SparseDDP does not support torch DDP's {', '.join(sorted(ddp_kwargs))} "
                            "(see docs/engine.md, 'torch DDP arguments')")
        if comm is not None and process_group is not None:
            raise TypeError("pass either comm or process_group, not both")
        if dim != 0:
            raise ValueError(f"SparseDDP splits nothing (inputs are per rank already); dim must be 0, got {dim}")
        _check_devices(module, device_ids, output_device)
        if merge is None:
            merge = "single" if bucket_cap_mb is None else f"buckets:{float(bucket_cap_mb):g}"
        elif bucket_cap_mb is not None:
            raise ValueError("pass either merge= or bucket_cap_mb=, not both")
        comm = as_comm(comm if comm is not None else process_group, module)
        self.module = module
        self.comm = comm
        self._gather_state = False  # True inside gathered_state_dict: _extra_state holds every rank's state
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        named = start_in_sync(module, comm, "SparseDDP", init_sync)
        sparse_ids = _sparse_grad_params(module)
        sparse_idx = [i for i, (_, p) in enumerate(named) if id(p) in sparse_ids]
        self._engine = OverlapEngine(
            [p for _, p in named], [n for n, _ in named], comm, reducer, density, reducer_options, merge,
            nonfinite=nonfinite, unused=unused, profile_warmup=profile_warmup, profile_steps=profile_steps,
            cost_model=cost_model, profile=profile, timeline=timeline, timeline_steps=timeline_steps,
            sparse_params=sparse_idx, cost_max_bytes=cost_max_bytes, policy=policy, delay=delay)
        self._engine.buffers.as_view = self.gradient_as_bucket_view
        if self.broadcast_buffers and comm.world_size > 1:
            self._engine.after_step = self._sync_buffers

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # timestamps the start of backward (``backward_s``); skipped while dynamo traces, so a
            # compiled forward has no graph break (then backward_s starts at the first gradient)
            eng = self._engine
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(eng.backward_started)
        return out

    def _sync_buffers(self):
        bufs = list(self.module.buffers())
        if bufs:
            with self.comm.phase("sparseddp-buffers"):
                _broadcast_tensors(bufs, self.comm)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside the block only accumulate local gradients (like DDP.no_sync)."""
        prev = self._engine.sync_enabled
        self._engine.sync_enabled = False
        try:
            yield
        finally:
            self._engine.sync_enabled = prev

    def join(self, *args, **kwargs):
        """Uneven inputs are not shadowed: every rank must run the same number of synchronised steps.

        Raises ``NotImplementedError`` with the recipe (also in ``docs/engine.md``, "Uneven inputs"):
        agree on the step count before the loop, e.g. ``n = ss.ddp.agree_steps(len(loader), comm)``
        (one all-reduce: the minimum over ranks), or use ``DistributedSampler(drop_last=True)``.
        """
        raise NotImplementedError(
            "SparseDDP.join(): uneven inputs are not supported - a rank that stops early would leave the "
            "others waiting in the sparse collectives. Run the same number of steps on every rank: "
            "steps = sparsync.ddp.agree_steps(len(loader), comm) (minimum over ranks) or "
            "DistributedSampler(drop_last=True). See docs/engine.md, 'Uneven inputs'.")

    # ------------------------------------------------------------------ information
    @property
    def last_stats(self) -> dict:
        """Statistics of the last synchronised step (see ``docs/engine.md``, "Statistics")."""
        return self._engine.last_stats

    @property
    def groups(self) -> list[list[str]]:
        """Current merge groups as parameter names, in communication order."""
        e = self._engine
        return [[e.names[i] for i in g] for g in e.groups]

    @property
    def engine(self) -> OverlapEngine:
        return self._engine

    @property
    def reducers(self) -> list:
        return self._engine.reducers

    @property
    def policy(self):
        return self._engine.policy

    def predictions(self, t_f: float = 0.0) -> dict:
        """Predicted iteration time per strategy (after profiling; empty before)."""
        return self._engine.predictions(t_f=t_f)

    # ------------------------------------------------------------------ state
    # The model's tensors come out of ``state_dict()`` like torch DDP's (``module.<name>``, and
    # ``_orig_mod.module.<name>`` under torch.compile; ``prefix``/``destination``/``keep_vars`` as
    # any nn.Module). The engine state (plan, reducers' residuals/thresholds/controllers/steps,
    # the policy's state) is this module's *extra state*: key ``<prefix>_extra_state``.
    def get_extra_state(self) -> dict:
        if self._gather_state:
            return self.gathered_sparsync_state_dict()
        return self.sparsync_state_dict()

    def set_extra_state(self, state) -> None:
        self.load_sparsync_state_dict(state)

    def sparsync_state_dict(self) -> dict:
        """The engine state alone (no model tensors, no process group): what ``_extra_state`` holds.
        Per rank (residuals): it records ``rank`` and ``world_size``, and loading it on another rank
        raises ``ValueError`` (see :mod:`sparsync.rankstate`)."""
        return rankstate.stamp(self._engine.state_dict(), self.comm.rank, self.comm.world_size)

    def gathered_sparsync_state_dict(self) -> dict:
        """Every rank's :meth:`sparsync_state_dict` in one object, the same on every rank (a
        collective): for a checkpoint that one rank writes; :meth:`load_sparsync_state_dict` takes it."""
        return rankstate.gather(self.sparsync_state_dict(), self.comm)

    def gathered_state_dict(self, *args, **kwargs) -> dict:
        """``state_dict()`` with every rank's sparsync state in ``_extra_state`` (a collective; the
        same on every rank), for a checkpoint that one rank writes: ``load_state_dict`` of it gives
        each rank its own state. Arguments as ``nn.Module.state_dict``."""
        self._gather_state = True
        try:
            return self.state_dict(*args, **kwargs)
        finally:
            self._gather_state = False

    def load_sparsync_state_dict(self, state: dict) -> None:
        if isinstance(state, dict) and "sparsync" in state and "reducers" not in state:
            state = state["sparsync"]  # the pre-0.2 layout {"module", "sparsync"}
        state = rankstate.own(state, self.comm.rank, self.comm.world_size, "SparseDDP")
        if state is None:
            raise ValueError(f"SparseDDP: the gathered state has no entry for rank {self.comm.rank}")
        if not isinstance(state, dict) or "reducers" not in state:
            raise ValueError("expected the dict returned by SparseDDP.sparsync_state_dict() "
                             f"(the '_extra_state' entry of SparseDDP.state_dict()), got {type(state).__name__}")
        self._engine.load_state_dict(state)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``; also takes the pre-0.2 layout ``{"module", "sparsync"}``."""
        if isinstance(state_dict, dict) and set(state_dict) == {"module", "sparsync"}:
            state_dict = {**{f"module.{k}": v for k, v in state_dict["module"].items()},
                          "_extra_state": state_dict["sparsync"]}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def flush(self) -> bool:
        """``delay=1``: wait for the step in flight and write its average into ``.grad`` (for a
        last ``optimizer.step()``). False when nothing was pending (always with ``delay=0``)."""
        return self._engine.flush()

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        self._engine.close()

    def __del__(self):
        try:
            self._engine.close()
        except (AttributeError, TypeError):  # __init__ failed before the engine existed, or interpreter
            pass  # shutdown already cleared module globals (None); anything else is reported by Python


def agree_steps(n_local: int, comm=None) -> int:
    """The number of steps every rank can run: the minimum of ``n_local`` over ranks (one all-reduce)."""
    comm = as_comm(comm)
    if comm.world_size == 1:
        return int(n_local)
    with comm.unrecorded():
        t = comm.allreduce(torch.tensor([-int(n_local)], dtype=torch.int64, device=comm.device), op="max")
    return -int(t[0])


def _check_devices(module, device_ids, output_device):
    devs = {p.device for p in module.parameters()}
    if device_ids is not None:
        ids = list(device_ids)
        if len(ids) != 1:
            raise ValueError(f"device_ids must be None or name one device (single-device modules), got {ids}")
        want = torch.device(ids[0] if not isinstance(ids[0], int) else f"cuda:{ids[0]}")
        if devs != {want}:
            raise ValueError(f"device_ids={ids}: the module's parameters are on {sorted(map(str, devs))}; "
                             "SparseDDP does not move the module - move it first (model.to(device))")
    if output_device is not None:
        want = torch.device(output_device if not isinstance(output_device, int) else f"cuda:{output_device}")
        if devs != {want}:
            raise ValueError(f"output_device={output_device}: outputs stay on the module's device "
                             f"{sorted(map(str, devs))}; SparseDDP does not move them")


# ---------------------------------------------------------------------- helpers
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def start_in_sync(module, comm, who: str, init_sync: bool = True) -> list:
    """The module's trainable ``(name, parameter)`` pairs, checked to be the same on every rank, with
    rank 0's parameters and buffers broadcast to all (unless ``init_sync`` is False). ``who`` names
    the wrapper in errors and in the ledger phase."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{who}: the module has no trainable parameters")
    _check_same_params(comm, named)
    if comm.world_size > 1 and init_sync:
        with comm.phase(f"{who.lower()}-init"):
            _broadcast_tensors([p for _, p in module.named_parameters()] + list(module.buffers()), comm)
    return named


def _check_same_params(comm, named):
    """Every rank must have the same trainable parameters: count, then shapes + dtypes."""
    comm.check_same(len(named), "number of trainable parameters")
    if comm.world_size == 1:
        return
    rows = []
    for _, p in named:
        if p.dim() > 8:
            raise ValueError("SparseDDP supports parameters of at most 8 dimensions")
        code = _DTYPES.index(p.dtype) if p.dtype in _DTYPES else 99
        rows.append([p.dim(), code] + list(p.shape) + [-1] * (8 - p.dim()))
    mine = torch.tensor(rows, dtype=torch.int64, device=comm.device).reshape(-1)
    with comm.unrecorded():
        allr = [t.cpu().reshape(len(named), 10) for t in comm.allgather(mine)]
    for r, t in enumerate(allr):
        diff = (t != allr[0]).any(dim=1).nonzero()
        if diff.numel():
            i = int(diff[0])
            name = named[i][0]

            def desc(row):
                d = int(row[0])
                dt = _DTYPES[int(row[1])] if int(row[1]) < len(_DTYPES) else "?"
                return f"shape {tuple(int(x) for x in row[2:2 + d])} {dt}"

            raise ValueError(f"SparseDDP: trainable parameter #{i} ({name!r}) differs across ranks: "
                             f"{desc(allr[0][i])} on rank 0 but {desc(t[i])} on rank {r}; every rank must "
                             "build the same model")


def _broadcast_tensors(tensors, comm, src=0):
    """Broadcast a list of tensors from ``src`` in place (one message per dtype)."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for ts in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            if flat.dtype == torch.bool:
                out = comm.broadcast(flat.to(torch.uint8), src).to(torch.bool)
            else:
                out = comm.broadcast(flat, src)
            for t, piece in zip(ts, torch.split(out, [t.numel() for t in ts])):
                t.copy_(piece.view_as(t))


def _sparse_grad_params(module) -> set:
    ids = set()
    for m in module.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            ids.add(id(m.weight))
    return ids
