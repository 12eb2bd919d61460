"""Overlap engine: gradient hooks, merge groups and one communication thread per rank.

This is the machinery behind :class:`sparsync.SparseDDP` (``spec/mgwfbp.md`` §5, Algorithm 2, in
PyTorch form):

* A post-accumulate-grad hook on every trainable parameter marks it ready. When the last tensor of
  a group (consecutive tensors in backward order, one reducer per group) is ready, the group's
  gradients are flattened into one 1-D tensor and handed to the communication thread.
* The communication thread is a single FIFO worker per rank. Groups are *submitted* strictly in
  plan order (group ``g+1`` waits for group ``g`` even when it is ready first), so every rank issues
  the same collectives in the same order — gloo and NCCL both need that — while backward keeps
  computing on the caller's thread (the overlap).
* At the end of backward (a callback queued on the autograd engine) parameters that got no gradient
  this step contribute zeros (``find_unused_parameters`` semantics: no hang), the engine waits for
  every group, optionally exchanges one tiny flag vector (non-finite / unused counts, so every rank
  takes the same decision; only for ``nonfinite="skip"`` / ``unused="error"``), then writes ``sum/P``
  back into ``param.grad``.
* ``merge="mgwfbp"|"optimal"``: the first ``profile_warmup + profile_steps`` steps run with the
  provisional ``single`` plan (no overlap, so backward times are not disturbed by communication);
  at the end of the last profiled step every rank takes rank 0's profile, fits the cost model on
  the live group and switches to the new plan — at the same step on all ranks. Reducer residuals
  are carried over per parameter; the step counter is kept; other per-reducer state (thresholds,
  controllers) is kept only for groups that did not change.

Non-finite gradients: a group whose local gradient has a NaN/Inf is replaced by zeros before it
reaches the reducer (so residuals never absorb NaN). With ``nonfinite="error"`` (default) the rank
that saw it raises ``FloatingPointError`` after the step's communication (no extra collective; the
launcher - ``run_local`` or torchrun - then stops every rank). With ``"skip"`` one tiny flag
all-gather tells every rank, and all drop the step (all ``.grad`` set to None, so
``optimizer.step()`` changes nothing; what the reducers transmitted in that step is dropped with it).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
import zlib

import numpy as np
import torch

from ..reducers.registry import load_all, make_reducer
from .costmodel import CostModel
from .merge import STRATEGIES, evaluate, make_plan, needs_model, parse_strategy
from .profiler import BackwardProfile, ProfileRecorder
from .timeline import Timeline

__all__ = ["OverlapEngine"]


class _Worker:
    """One daemon thread running closures in FIFO order (the rank's communication thread)."""

    def __init__(self, name: str):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            fn = self.q.get()
            if fn is None:
                return
            fn()

    def submit(self, fn):
        self.q.put(fn)

    def close(self):
        self.q.put(None)


class OverlapEngine:
    def __init__(self, params, names, comm, reducer="dense", density=0.01, reducer_options=None,
                 merge="single", *, nonfinite="error", unused="zero", profile_warmup=2, profile_steps=5,
                 cost_model=None, profile=None, timeline=None, timeline_steps=50, sparse_params=(),
                 cost_max_bytes=64 << 20):
        if nonfinite not in ("error", "skip", "ignore"):
            raise ValueError(f"nonfinite must be 'error', 'skip' or 'ignore', got {nonfinite!r}")
        if unused not in ("zero", "error"):
            raise ValueError(f"unused must be 'zero' or 'error', got {unused!r}")
        parse_strategy(merge)
        reducers = load_all()
        if reducer not in reducers:
            raise ValueError(f"unknown reducer {reducer!r}; valid: {', '.join(sorted(reducers))}")
        self.params = list(params)
        self.names = list(names)
        self.n = len(self.params)
        self.comm = comm
        self.P = comm.world_size
        self.reducer_name = reducer
        self.density = density
        self.reducer_options = dict(reducer_options or {})
        make_reducer(reducer, comm, density, **self.reducer_options)  # validate options now
        self.merge = merge
        self.nonfinite = nonfinite
        self.unused_mode = unused
        self.sizes = [p.numel() * p.element_size() for p in self.params]
        self.cuda = any(p.is_cuda for p in self.params)
        has_sparse = hasattr(reducers[reducer], "reduce_sparse")
        self.sparse_path = {i for i in sparse_params} if has_sparse else set()
        self.profile_warmup = int(profile_warmup)
        self.profile_steps = int(profile_steps)
        self.cost_max_bytes = int(cost_max_bytes)
        self.cost_model = _as_cost_model(cost_model)
        self.profile = _as_profile(profile, self.n)
        self.recorder = ProfileRecorder(self.n)
        self.order = list(reversed(range(self.n)))  # provisional: reverse registration order
        self.steps_done = 0
        self.skipped_steps = 0
        self.prediction: dict | None = None
        self.final = not needs_model(merge)
        if self.final:
            groups = self._plan_groups(merge, self.order, None)
        elif self.profile is not None and self.cost_model is not None:
            self.order = list(self.profile.order)
            groups = self._plan_groups(merge, self.order, self.profile.t_b)
            self.final = True
        else:
            groups = self._plan_groups("single", self.order, None)
        self._set_groups(groups, migrate=False)
        self.timeline = Timeline(timeline, comm.rank, comm.world_size, timeline_steps) if timeline else None
        self.sync_enabled = True
        self.last_stats: dict = {}
        self._lock = threading.RLock()
        self._step_active = False
        self._bw_start = None
        self._worker = _Worker(f"sparsync-comm-rank{comm.rank}")
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ plans
    def _plan_groups(self, strategy, order, t_b, cm=None):
        sizes = [self.sizes[i] for i in order]
        cm = cm or self.cost_model
        ranges = make_plan(strategy, t_b, sizes, *( (cm.a, cm.b) if cm is not None else (0.0, 0.0)))
        return self._split([[order[k] for k in range(i, j)] for i, j in ranges])

    def _split(self, groups):
        """Groups may not mix dtypes/devices; sparse-path parameters travel alone."""
        out = []
        for g in groups:
            cur, key = [], None
            for i in g:
                p = self.params[i]
                k = (p.dtype, p.device)
                if i in self.sparse_path:
                    if cur:
                        out.append(cur)
                    out.append([i])
                    cur, key = [], None
                    continue
                if cur and k != key:
                    out.append(cur)
                    cur = []
                cur.append(i)
                key = k
            if cur:
                out.append(cur)
        return out

    def _set_groups(self, groups, migrate=True):
        old_groups = getattr(self, "groups", None)
        old_reducers = getattr(self, "reducers", None)
        self.groups = [list(g) for g in groups]
        self.group_of = [0] * self.n
        for gi, g in enumerate(self.groups):
            for i in g:
                self.group_of[i] = gi
        if sorted(i for g in self.groups for i in g) != list(range(self.n)):
            raise RuntimeError("internal error: merge groups do not cover every parameter exactly once")
        self.group_numel = [sum(self.params[i].numel() for i in g) for g in self.groups]
        if not migrate or not old_reducers:
            self.reducers = [self._new_reducer() for _ in self.groups]
            return
        # carry residuals over per parameter (spec: error feedback must not lose mass at a switch)
        same = {tuple(g): r for g, r in zip(old_groups, old_reducers)}
        per_param, step = {}, max(r.step for r in old_reducers)
        for g, r in zip(old_groups, old_reducers):
            if r.residual is not None:
                for i, piece in zip(g, torch.split(r.residual, [self.params[i].numel() for i in g])):
                    per_param[i] = piece
        self.reducers = []
        for g in self.groups:
            r = same.get(tuple(g))
            if r is None:
                r = self._new_reducer()
                r.step = step
                if all(i in per_param for i in g):
                    r.residual = torch.cat([per_param[i] for i in g]).clone()
                    r.numel = r.residual.numel()
            self.reducers.append(r)

    def _new_reducer(self):
        # _prepare already checked every gradient for NaN/Inf (self.nonfinite): the reducer need not
        return make_reducer(self.reducer_name, self.comm, self.density, **{**self.reducer_options,
                                                                            "nonfinite": "ignore"})

    def _switch_plan(self):
        """End of profiling: same inputs on every rank -> same plan on every rank."""
        comm = self.comm
        prof = self.profile or self.recorder.result().broadcast(comm)
        cm = self.cost_model or CostModel.measure(comm, self.reducer_name, self.density, self.reducer_options,
                                                  max_bytes=min(self.cost_max_bytes, max(sum(self.sizes), 1 << 16)))
        self.profile, self.cost_model = prof, cm
        self.order = list(prof.order)
        groups = self._plan_groups(self.merge, self.order, prof.t_b)
        sig = zlib.crc32(repr(groups).encode())
        comm.check_same(sig, "merge plan (crc32)")
        self._set_groups(groups, migrate=True)
        self.final = True

    def predictions(self, strategies=STRATEGIES, t_f: float = 0.0) -> dict:
        """Predicted timeline of every strategy under the current profile and cost model."""
        if self.profile is None or self.cost_model is None:
            return {}
        sizes = [self.sizes[i] for i in self.profile.order]
        cm = self.cost_model
        out = {}
        for s in strategies:
            ranges = make_plan(s, self.profile.t_b, sizes, cm.a, cm.b)
            out[s] = evaluate(ranges, self.profile.t_b, sizes, cm.a, cm.b, t_f)
        return out

    # ------------------------------------------------------------------ step
    def mark_backward_start(self):
        if self.sync_enabled and self._bw_start is None:
            self._bw_start = time.perf_counter()

    def _make_hook(self, i):
        def hook(p):
            if not self.sync_enabled:
                return
            if self.cuda and not self.final:
                torch.cuda.synchronize()
            now = time.perf_counter()
            with self._lock:
                if not self._step_active:
                    self._begin_step(now)
                if self._seen[i]:
                    raise RuntimeError(
                        f"SparseDDP: the gradient of parameter {self.names[i]!r} was accumulated twice in one "
                        "backward pass (reentrant checkpointing or a second backward inside the first?)")
                self._seen[i] = True
                self._order_seen.append(i)
                self._ready_t.append(now)
                g = self.group_of[i]
                self._pending[g] -= 1
                if self._pending[g] == 0:
                    self._group_ready(g)
        return hook

    def _begin_step(self, now):
        G = len(self.groups)
        self._step_active = True
        self._t_start = self._bw_start if self._bw_start is not None else now
        self._seen = [False] * self.n
        self._pending = [len(g) for g in self.groups]
        self._ready = [False] * G
        self._next_submit = 0
        self._outs = [None] * G
        self._bad_local: list[int] = []
        self._error = None
        self._done = threading.Event()
        self._order_seen: list[int] = []
        self._ready_t: list[float] = []
        self._spans: list[tuple[int, float, float]] = []
        self._rstats = {"select_s": 0.0, "comm_s": 0.0, "bytes_sent": 0, "bytes_received": 0, "selected": 0}
        self._flags = None
        self._stash: dict = {}
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _group_ready(self, g):
        """Called (under the lock) when group ``g``'s last tensor is ready: capture the gradients and
        submit every group that is now next in plan order. Flattening and the finiteness check run
        on the communication thread, so backward is not held up."""
        idx = self.groups[g]
        if len(idx) == 1 and idx[0] in self.sparse_path:
            payload = ("sparse", [self.params[idx[0]].grad])
        else:
            payload = ("dense", [self.params[i].grad for i in idx])
        self._stash[g] = payload
        self._ready[g] = True
        G = len(self.groups)
        while self._next_submit < G and self._ready[self._next_submit]:
            k = self._next_submit
            pl = self._stash.pop(k)
            self._worker.submit(lambda k=k, pl=pl: self._reduce(k, pl))
            self._next_submit += 1

    def _prepare(self, g, payload):
        """(kind, tensor): the group's flat gradient, or a coalesced COO for the sparse path.

        Missing gradients become zeros; a non-finite group becomes zeros (recorded in ``_bad_local``)
        so the reducer never sees NaN/Inf and every rank still makes the same calls.
        """
        kind, grads = payload
        idx = self.groups[g]
        check = self.nonfinite != "ignore"
        if kind == "sparse":
            p = self.params[idx[0]]
            gr = grads[0]
            if gr is None:
                x = _empty_coo(p)
            else:
                x = (gr if gr.is_sparse else gr.to_sparse(1)).coalesce()
            if check and not bool(torch.isfinite(x._values()).all()):
                self._bad_local.append(g)
                x = _empty_coo(p)
            return "sparse", x
        parts = []
        for i, gr in zip(idx, grads):
            p = self.params[i]
            if gr is None:
                gr = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            elif gr.is_sparse:
                gr = gr.to_dense()
            parts.append(gr.reshape(-1))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        if check and not bool(torch.isfinite(flat).all()):
            self._bad_local.append(g)
            flat = torch.zeros_like(flat)
        return "dense", flat

    def _reduce(self, g, payload):
        if self._error is not None:
            return
        try:
            r = self.reducers[g]
            t0 = time.perf_counter()
            kind, x = self._prepare(g, payload)
            out = r.reduce_sparse(x) if kind == "sparse" else r.reduce(x)
            t1 = time.perf_counter()
            self._outs[g] = out
            self._spans.append((g, t0, t1))
            st = r.stats
            for k in self._rstats:
                self._rstats[k] += st.get(k, 0) or 0
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            self._error = (g, e, traceback.format_exc())

    def _final_exchange(self):
        try:
            # Only "skip" and unused="error" need every rank to take the same decision; the default
            # "error" raises on the rank that saw the NaN (the launcher then stops every rank), so the
            # common path pays no extra collective (it cost ~18 ms a step on the emulated cluster).
            if self._error is None and (self.nonfinite == "skip" or self.unused_mode == "error"):
                with self.comm.unrecorded():
                    v = torch.tensor([len(self._bad_local), len(self._unused)], dtype=torch.int64,
                                     device=self.comm.device)
                    self._flags = [t.cpu().tolist() for t in self.comm.allgather(v)]
        except BaseException as e:  # noqa: BLE001
            self._error = (-1, e, traceback.format_exc())
        finally:
            self._done.set()

    def _finish(self):
        t_end = time.perf_counter()
        try:
            with self._lock:
                self._unused = [i for i in range(self.n) if not self._seen[i]]
                for i in self._unused:
                    self._seen[i] = True
                    g = self.group_of[i]
                    self._pending[g] -= 1
                    if self._pending[g] == 0:
                        self._group_ready(g)
                self._worker.submit(self._final_exchange)
            self._done.wait()
            t_done = time.perf_counter()
            self._complete(t_end, t_done)
        finally:
            self._step_active = False
            self._bw_start = None
            self._stash = {}

    def _complete(self, t_end, t_done):
        comm = self.comm
        if self._error is not None:
            g, e, tb = self._error
            what = "the final flag exchange" if g < 0 else f"group {g} ({len(self.groups[g])} tensors)"
            raise RuntimeError(f"rank {comm.rank}: SparseDDP communication of {what} failed: "
                               f"{type(e).__name__}: {e}\n{tb}") from e
        if self._flags is None:  # no exchange this step: what this rank saw
            flags = {comm.rank: [len(self._bad_local), len(self._unused)]}
        else:
            flags = dict(enumerate(self._flags))
        bad_ranks = [r for r, f in flags.items() if f[0]]
        skipped = False
        if self.unused_mode == "error" and any(f[1] for f in flags.values()):
            names = [self.names[i] for i in self._unused]
            raise RuntimeError(
                f"rank {comm.rank}: parameters received no gradient this step on ranks "
                f"{[r for r, f in flags.items() if f[1]]} (here: {names[:8]}); pass unused='zero' to let "
                "them contribute zeros (like DDP's find_unused_parameters)")
        if bad_ranks:
            if self.nonfinite == "error":
                names = [self.names[i] for g in self._bad_local for i in self.groups[g]]
                raise FloatingPointError(
                    f"rank {comm.rank}: non-finite (NaN/Inf) gradients at step {self.steps_done} on ranks "
                    f"{bad_ranks}" + (f" (here in {names[:8]})" if names else "") +
                    "; pass nonfinite='skip' to drop such steps")
            skipped = True
            self.skipped_steps += 1
            for p in self.params:
                p.grad = None
        else:
            inv = 1.0 / self.P
            for g, idx in enumerate(self.groups):
                out = self._outs[g]
                if out.is_sparse:
                    p = self.params[idx[0]]
                    p.grad = (out.coalesce() * inv).reshape(p.shape) if out.dim() != p.dim() else out.coalesce() * inv
                    continue
                avg = out.reshape(-1) / self.P if self.P > 1 else out.reshape(-1).clone()
                if len(idx) == 1:
                    p = self.params[idx[0]]
                    p.grad = avg.view_as(p)
                else:
                    for i, piece in zip(idx, torch.split(avg, [self.params[i].numel() for i in idx])):
                        self.params[i].grad = piece.view_as(self.params[i])
        numel = sum(self.group_numel)
        rs = self._rstats
        self.last_stats = {
            "step": self.steps_done,
            "select_s": rs["select_s"],
            "comm_s": rs["comm_s"],
            "reduce_s": sum(t1 - t0 for _, t0, t1 in self._spans),
            "wait_s": t_done - t_end,
            "backward_s": t_end - self._t_start,
            "bytes_sent": int(rs["bytes_sent"]),
            "bytes_received": int(rs["bytes_received"]),
            "selected": int(rs["selected"]),
            "numel": numel,
            "density": rs["selected"] / max(1, numel),
            "groups": len(self.groups),
            "unused": len(self._unused),
            "skipped": skipped,
            "final_plan": self.final,
        }
        if self.timeline is not None:
            prev = self._t_start
            for i, t in zip(self._order_seen, self._ready_t):
                self.timeline.slice("backward", self.names[i], prev, t, bytes=self.sizes[i])
                prev = t
            for g, t0, t1 in self._spans:
                self.timeline.slice("comm", f"group {g}", t0, t1, tensors=len(self.groups[g]),
                                    bytes=sum(self.sizes[i] for i in self.groups[g]))
            self.timeline.slice("wait", "wait", t_end, t_done)
            self.timeline.end_step()
        self.steps_done += 1
        if not self.final:
            if self.steps_done > self.profile_warmup:
                order = self._order_seen + self._unused
                ready = self._ready_t + [t_end] * len(self._unused)
                self.recorder.add(self._t_start, order, ready)
            if self.steps_done >= self.profile_warmup + self.profile_steps:
                self._switch_plan()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "version": 1,
            "reducer": self.reducer_name,
            "merge": self.merge,
            "n_params": self.n,
            "steps_done": self.steps_done,
            "skipped_steps": self.skipped_steps,
            "final": self.final,
            "groups": [list(g) for g in self.groups],
            "order": list(self.order),
            "profile_samples": self.recorder.state(),
            "profile": None if self.profile is None else self.profile.to_dict(),
            "cost_model": None if self.cost_model is None else self.cost_model.to_dict(),
            "reducers": [r.state_dict() for r in self.reducers],
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("reducer") != self.reducer_name:
            raise ValueError(f"checkpoint is for reducer {d.get('reducer')!r}, "
                             f"this SparseDDP uses {self.reducer_name!r}")
        if d.get("n_params") != self.n:
            raise ValueError(f"checkpoint has {d.get('n_params')} trainable parameters, the model has {self.n}")
        if self._step_active:
            raise RuntimeError("cannot load state in the middle of a backward pass")
        self.steps_done = int(d["steps_done"])
        self.skipped_steps = int(d.get("skipped_steps", 0))
        self.final = bool(d["final"])
        self.order = list(d["order"])
        self.recorder.load(d.get("profile_samples") or [])
        self.profile = None if d.get("profile") is None else BackwardProfile(**d["profile"])
        self.cost_model = None if d.get("cost_model") is None else CostModel.from_dict(d["cost_model"])
        self._set_groups(d["groups"], migrate=False)
        for r, s in zip(self.reducers, d["reducers"]):
            r.load_state_dict(s)

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        self._worker.close()


def _empty_coo(p):
    """An all-zero gradient in the embedding layout (hybrid COO, one sparse dimension)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=p.device),
                                   torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device), p.shape,
                                   check_invariants=True, is_coalesced=True)


def _as_cost_model(cm):
    if cm is None or isinstance(cm, CostModel):
        return cm
    if isinstance(cm, dict):
        return CostModel.from_dict(cm) if "a" in cm else CostModel(**cm)
    a, b = cm
    return CostModel(float(a), float(b), None, "given")


def _as_profile(prof, n):
    if prof is None:
        return None
    if isinstance(prof, dict):
        prof = BackwardProfile(list(prof["order"]), list(prof["t_b"]), int(prof.get("steps", 0)))
    if sorted(prof.order) != list(range(n)) or len(prof.t_b) != n:
        raise ValueError(f"profile must give an order over all {n} trainable parameters and one time each")
    if not np.isfinite(np.asarray(prof.t_b, dtype=float)).all():
        raise ValueError("profile times must be finite")
    return prof
