"""Overlap engine: gradient hooks feeding one communication thread per rank, group by group.

This is the machinery behind :class:`sparsync.SparseDDP` (MG-WFBP: Shi, Chu & Li, "MG-WFBP: Efficient
Data Communication for Distributed Synchronous SGD Algorithms", INFOCOM 2019, Algorithm 2, in
PyTorch form). It orchestrates parts that each have one job:

* :mod:`.planner` - which parameters travel together (merge plan; profiling + cost-model fit for
  ``mgwfbp``/``optimal`` and the switch to the final plan);
* :mod:`.groups` - plan -> communication groups (dtype/device/sparse split) and the residual
  carry-over when the plan changes;
* :mod:`.buffers` - one persistent flat gradient buffer per group, ``.grad`` as views into it
  (no per-step ``cat``/split, the division by P folded into the write-back pass);
* :mod:`.guards` - non-finite / unused-parameter policy, identical decisions on every rank;
* :mod:`.inputs` - one group's input to its reducer: gathered, checked, through the convergence
  policy (folded into the reducer's memory where both declare it);
* :mod:`.worker` - the FIFO communication thread;
* :mod:`.stepstats` - ``last_stats`` (a step breakdown in which the wait is fully accounted for) and
  the timeline;
* :mod:`.stepcomm` - one step's communication (outputs, guard inputs, error, completion).

The step: a post-accumulate-grad hook on every trainable parameter marks it ready. When the last
tensor of a group is ready, the group is handed to the communication thread - groups are
*submitted* strictly in plan order, so every rank issues the same collectives in the same order
(gloo and NCCL need that) while backward keeps computing on the caller's thread. There the group's
gradients are gathered into its flat buffer, checked, passed through the convergence policy
(``policy.before_reduce``, :mod:`sparsync.convergence`), reduced, and ``policy.after_reduce`` runs.
At the end of backward (a callback queued on the autograd engine), parameters that got no gradient
contribute zeros, the engine waits for every group, applies the guard's decision and writes
``sum / P`` into the flat buffers (``.grad`` views).

The engine reads declared capabilities, never probes: the reducer class's ``sparse_input``,
``indexed_output`` and ``accepts_fold`` (:data:`sparsync.reducers.base.CAPABILITIES`), the policy's
``reads_parts`` and ``folds`` (:class:`sparsync.convergence.ConvergencePolicy`, checked at
construction); the cheap input paths they open are in :mod:`.inputs`. A reducer with
``indexed_output`` returns an :class:`~sparsync.reducers.base.IndexedSum` and the write-back clears
only last step's non-zeros (:meth:`GradBuffers.write_indexed`) instead of a dense divide pass.

Delayed averaging (``delay=1``): nothing is submitted during backward; at its end
the previous step's result is applied and this step's reduces are queued, to run while the caller
computes the next step (:meth:`OverlapEngine._finish_delayed`). Each step's communication is one
:class:`~.stepcomm.StepComm` (outputs, guard inputs, error, completion event, accounting), which
with a delay outlives its step and is part of the state. One module because it is one class with one
job: the step's life cycle (hooks, submission, finish, delayed finish, write-back, state) is one
state machine around one lock, and every stage it drives lives in the modules above.
"""

from __future__ import annotations

import threading
import time
import traceback

import torch

from ..convergence import ConvergencePolicy
from ..reducers.base import IndexedSum
from ..reducers.registry import load_all, make_reducer
from .buffers import GradBuffers
from .groups import check_cover, migrate_reducers, split_groups
from .guards import StepGuard
from .inputs import InputStage
from .merge import STRATEGIES
from .planner import Planner
from .stepcomm import StepComm
from .stepstats import GroupSpan, StepStats
from .timeline import Timeline
from .worker import CommWorker

__all__ = ["OverlapEngine"]

STATE_VERSION = 2


class OverlapEngine:
    def __init__(self, params, names, comm, reducer="dense", density=0.01, reducer_options=None,
                 merge="single", *, nonfinite="error", unused="zero", profile_warmup=2, profile_steps=5,
                 cost_model=None, profile=None, timeline=None, timeline_steps=50, sparse_params=(),
                 cost_max_bytes=64 << 20, policy=None, delay=0):
        self.guard = StepGuard(nonfinite, unused)
        if delay not in (0, 1) or isinstance(delay, bool):
            raise ValueError(f"delay must be 0 (average this step's gradients) or 1 (apply the previous "
                             f"step's average; see docs/engine.md), got {delay!r}")
        self.delay = int(delay)
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
        self.policy = _check_policy(policy)
        self.sizes = [p.numel() * p.element_size() for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.cuda = any(p.is_cuda for p in self.params)
        self.sparse_path = set(sparse_params) if reducers[reducer].sparse_input else set()
        self.planner = Planner(merge, self.sizes, profile_warmup=profile_warmup, profile_steps=profile_steps,
                               cost_model=cost_model, profile=profile, cost_max_bytes=cost_max_bytes)
        if self.delay and not self.planner.final:
            raise ValueError(f"delay=1 needs a merge plan that is final from the start (single, wfbp, "
                             f"buckets:<MB>, or {merge} with profile= and cost_model=): the plan switch after "
                             "profiling would change the groups under a step still in flight")
        self.buffers = GradBuffers(self.params)
        self.inputs = InputStage(self.params, self.numels, self.buffers, self.guard, self.policy, self.sparse_path)
        self._inflight: StepComm | None = None  # delay=1: the previous step's communication, not applied yet
        self.steps_done = 0
        self.skipped_steps = 0
        self.groups: list[list[int]] = []
        self.reducers: list = []
        self._set_groups(self.planner.initial_plan(), migrate=False)
        self.timeline = Timeline(timeline, comm.rank, comm.world_size, timeline_steps) if timeline else None
        self.sync_enabled = True
        self.after_step = None  # called on every rank at the end of each synchronised step
        self.last_stats: dict = {}
        self._lock = threading.RLock()
        self._step_active = False
        self._bw_start = None
        self._worker = CommWorker(f"sparsync-comm-rank{comm.rank}")
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ plan views (read-only)
    @property
    def merge(self) -> str:
        return self.planner.merge

    @property
    def final(self) -> bool:
        return self.planner.final

    @property
    def order(self) -> list[int]:
        return self.planner.order

    @property
    def profile(self):
        return self.planner.profile

    @profile.setter
    def profile(self, prof):
        self.planner.profile = prof

    @property
    def cost_model(self):
        return self.planner.cost_model

    @cost_model.setter
    def cost_model(self, cm):
        self.planner.cost_model = cm

    @property
    def nonfinite(self) -> str:
        return self.guard.nonfinite

    def predictions(self, strategies=STRATEGIES, t_f: float = 0.0) -> dict:
        """Predicted timeline of every strategy under the current profile and cost model."""
        return self.planner.predictions(strategies, t_f=t_f)

    # ------------------------------------------------------------------ groups
    def _set_groups(self, groups, migrate=True):
        groups = split_groups(groups, self.params, self.sparse_path)
        check_cover(groups, self.n)
        old_groups, old_reducers = self.groups, self.reducers
        self.groups = groups
        self.group_of = [0] * self.n
        for gi, g in enumerate(groups):
            for i in g:
                self.group_of[i] = gi
        self.group_numel = [sum(self.numels[i] for i in g) for g in groups]
        self.buffers.set_groups(groups)
        if migrate and old_reducers:
            self.reducers = migrate_reducers(old_groups, old_reducers, groups, self.numels, self._new_reducer)
            if self.policy is not None:
                self.policy.on_regroup(old_groups, groups, self.numels)
        else:
            self.reducers = [self._new_reducer() for _ in groups]

    def _new_reducer(self):
        # _prepare already checked every gradient for NaN/Inf (self.nonfinite): the reducer need not
        return make_reducer(self.reducer_name, self.comm, self.density, **{**self.reducer_options,
                                                                            "nonfinite": "ignore"})

    # ------------------------------------------------------------------ step (training thread)
    def mark_backward_start(self):
        if self.sync_enabled and self._bw_start is None:
            self._bw_start = time.perf_counter()

    def backward_started(self, grad):
        """Tensor hook for the model output: timestamps the start of backward."""
        self.mark_backward_start()

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
                self._param_ready(i)
        return hook

    def _begin_step(self, now):
        self._step_active = True
        self._t_start = self._bw_start if self._bw_start is not None else now
        for r in self.reducers:  # when the compute began (auto's start decision weighs its candidates by it)
            r.compute_start = self._t_start
        self._seen = [False] * self.n
        self._pending = [len(g) for g in self.groups]
        self._ready = [False] * len(self.groups)
        self._next_submit = 0
        self._rec = StepComm(self.steps_done, len(self.groups))
        self._order_seen: list[int] = []
        self._ready_t: list[float] = []
        if not self.delay:  # with delay=1 the reducers may still be busy with the previous step: see _finish_delayed
            self._set_density()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _set_density(self):
        if self.policy is not None:
            d = float(self.policy.density(self.steps_done, self.density))
            for r in self.reducers:
                r.density = d

    def _param_ready(self, i):
        g = self.group_of[i]
        self._pending[g] -= 1
        if self._pending[g] == 0 and not self.delay:
            self._ready[g] = True
            G = len(self.groups)
            while self._next_submit < G and self._ready[self._next_submit]:
                k = self._next_submit
                grads = [self.params[j].grad for j in self.groups[k]]  # captured now, copied on the thread
                t = time.perf_counter()
                self._worker.submit(lambda k=k, grads=grads, t=t, rec=self._rec: self._reduce(rec, k, t, grads))
                self._next_submit += 1

    def _finish(self):
        t_end = time.perf_counter()
        try:
            with self._lock:
                rec = self._rec
                rec.unused = [i for i in range(self.n) if not self._seen[i]]
                for i in rec.unused:
                    self._seen[i] = True
                    self._param_ready(i)
                if not self.delay:
                    self._worker.submit(lambda: self._final_exchange(rec))
            if self.delay:
                self._finish_delayed(rec, t_end)
                return
            rec.done.wait()
            t_done = time.perf_counter()
            rec.raise_error(self.comm.rank, self.groups)
            skipped = self._apply(rec)
            self._complete(rec, rec.stats, t_end, t_done, time.perf_counter(), skipped)
        finally:
            self._step_active = False
            self._bw_start = None

    def _finish_delayed(self, rec, t_end):
        """``delay=1``: apply the previous step's average, start this step's communication.

        Order (every shared buffer has one writer at a time): (1) wait for the previous step's
        communication - it ran during this step's forward and backward, so normally it is done;
        (2) take this step's gradients out of ``.grad`` (a copy, or the policy's velocity update:
        the communication thread will read them while the caller computes the next step);
        (3) write the previous step's ``sum / P`` into ``.grad`` (nothing at the first step:
        ``.grad = None``, so ``optimizer.step()`` leaves the parameters alone); (4) the step's
        accounting and ``after_step`` (buffer broadcast: collectives on this thread, while the
        communication thread is idle); (5) queue this step's reduces and flag exchange."""
        self._drain()
        prev, self._inflight = self._inflight, None
        t_done = time.perf_counter()
        # this step's accounting: the reducers' work that ran during it (the previous step's) plus
        # this step's input stage on the training thread (after the wait window: in the totals only)
        stats = prev.stats if prev is not None else StepStats()
        inputs = []
        for g, idx in enumerate(self.groups):
            span = GroupSpan(g, t_done)
            inputs.append(self._group_input(rec, g, [self.params[j].grad for j in idx], span, own=True))
            span.close(None)
            stats.spans.append(span)
        stats.copied_bytes, rec.stats.copied_bytes = rec.stats.copied_bytes, 0
        if prev is None:
            skipped = False
            for p in self.params:
                p.grad = None
        else:
            skipped = self._apply(prev)
        t_written = time.perf_counter()
        self._set_density()
        # before the submission: after_step may issue collectives (buffer broadcast) on this thread,
        # which must not interleave with the communication thread's
        self._complete(rec, stats, t_end, t_done, t_written, skipped, applied=None if prev is None else prev.step)
        for g, x in enumerate(inputs):
            self._worker.submit(lambda g=g, x=x: self._reduce(rec, g, time.perf_counter(), x=x))
        self._worker.submit(lambda: self._final_exchange(rec))
        self._inflight = rec

    # ------------------------------------------------------------------ communication thread
    def _reduce(self, rec, g, t_submit, grads=None, x=None):
        """Reduce group ``g``: from its gradients ``grads``, or (``delay=1``) from the input ``x``
        the training thread already took (``_finish_delayed``)."""
        if rec.error is not None:
            return
        span = GroupSpan(g, t_submit)
        try:
            if x is None:
                x = self._group_input(rec, g, grads, span)
            self._run_reducer(rec, g, x, span)
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            rec.error = (g, e, traceback.format_exc())

    def _run_reducer(self, rec, g, x, span):
        r = self.reducers[g]
        if x.is_sparse:
            out = r.reduce_sparse(x)
            span.mark("reduce")
        else:
            # the engine's own buffer is donated: it is overwritten by the write-back anyway (not with
            # delay=1, whose next input is gathered into it before this result is written back)
            donate = not self.delay and self.buffers.owns(g, x)
            out = r.reduce(x, indexed=self.buffers.as_view, donate=donate)
            span.mark("reduce")
            if self.policy is not None:
                self.policy.after_reduce(g, r)
                span.mark("policy")
        rec.outs[g] = out
        span.close(r.stats)
        rec.stats.spans.append(span)
        rec.stats.add_reducer_stats(r.stats, g)

    def _group_input(self, rec, g, grads, span, own=False):
        """Group ``g``'s input to its reducer (:class:`.inputs.InputStage`)."""
        return self.inputs.build(rec, g, self.groups[g], grads, self.reducers[g], span, own=own)

    def _final_exchange(self, rec):
        try:
            if rec.error is None:
                rec.flags = self.guard.flags(self.comm, len(rec.bad_local), len(rec.unused))
        except BaseException as e:  # noqa: BLE001
            rec.error = (-1, e, traceback.format_exc())
        finally:
            rec.done.set()

    # ------------------------------------------------------------------ end of step (training thread)
    def _apply(self, rec) -> bool:
        """The guard's decision on ``rec``'s step, then ``.grad := sum / P`` (or None on a skipped
        step). Returns True when the step was skipped."""
        skipped = self.guard.decide(
            rec.flags, rank=self.comm.rank, step=rec.step,
            unused_names=[self.names[i] for i in rec.unused],
            bad_names=[self.names[i] for g in rec.bad_local for i in self.groups[g]])
        if skipped:
            self.skipped_steps += 1
            for p in self.params:
                p.grad = None
        else:
            self._write_back(rec.outs)
        rec.outs = [None] * len(rec.outs)  # let the reducers recycle their output buffers
        return skipped

    def _complete(self, rec, stats, t_end, t_done, t_written, skipped, applied=-1):
        """Accounting, timeline and plan switch at the end of a synchronised backward. ``stats``:
        the communication work that ran during this step (``rec``'s own, or with ``delay=1`` the
        previous step's); ``applied``: the step whose average ``.grad`` now holds."""
        numel = sum(self.group_numel)
        st = stats.summary(t_start=self._t_start, t_end=t_end, t_done=t_done, t_written=t_written)
        self.last_stats = {"step": self.steps_done, **st, "numel": numel,
                           "density": st["selected"] / max(1, numel), "groups": len(self.groups),
                           "unused": len(rec.unused), "skipped": skipped, "final_plan": self.final,
                           "applied_step": self.steps_done if applied == -1 else applied}
        if self.timeline is not None:
            stats.timeline(self.timeline, self.names, self.sizes, self.groups, self._order_seen,
                           self._ready_t, self._t_start, t_end, t_done)
        self.steps_done += 1
        order = self._order_seen + rec.unused
        ready = self._ready_t + [t_end] * len(rec.unused)
        if self.planner.observe(self.steps_done, self._t_start, order, ready):
            groups = self.planner.switch(self.comm, self.reducer_name, self.density, self.reducer_options)
            self._set_groups(groups, migrate=True)
        if self.after_step is not None:
            self.after_step()

    def _write_back(self, outs):
        """``.grad := out / P`` for every group. ``reduce_sparse`` returns a dense sum too, so a
        parameter on the sparse path gets a dense ``.grad`` (a view of its group's buffer)."""
        for g in range(len(self.groups)):
            out = outs[g]
            if isinstance(out, IndexedSum):
                self.buffers.write_indexed(g, out, self.P)
            else:
                self.buffers.write_average(g, out, self.P)

    def flush(self) -> bool:
        """``delay=1``: wait for the step still in flight and write its average into ``.grad``
        (for a last ``optimizer.step()``). Returns False when nothing was pending."""
        self._drain()
        rec, self._inflight = self._inflight, None
        if rec is None:
            return False
        self._apply(rec)
        return True

    def _drain(self):
        """Wait for the step in flight (its results stay pending)."""
        if self._inflight is not None:
            self._inflight.done.wait()
            self._inflight.raise_error(self.comm.rank, self.groups)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        self._drain()  # delay=1: the step in flight is part of the state (and its reducers must be idle)
        return {
            "version": STATE_VERSION,
            "reducer": self.reducer_name,
            "n_params": self.n,
            "steps_done": self.steps_done,
            "skipped_steps": self.skipped_steps,
            **self.planner.state_dict(),
            "groups": [list(g) for g in self.groups],
            "reducers": [r.state_dict() for r in self.reducers],
            "policy": None if self.policy is None else self.policy.state_dict(),
            "delay": self.delay,
            "inflight": None if self._inflight is None else self._inflight.state_dict(),
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("reducer") != self.reducer_name:
            raise ValueError(f"checkpoint is for reducer {d.get('reducer')!r}, "
                             f"this SparseDDP uses {self.reducer_name!r}")
        if d.get("n_params") != self.n:
            raise ValueError(f"checkpoint has {d.get('n_params')} trainable parameters, the model has {self.n}")
        if self._step_active:
            raise RuntimeError("cannot load state in the middle of a backward pass")
        if d.get("policy") is not None and self.policy is None:
            raise ValueError("checkpoint holds a convergence policy's state; pass the same policy= to SparseDDP")
        if d.get("inflight") is not None and not self.delay:
            raise ValueError("checkpoint holds a step in flight (saved with delay=1): pass delay=1 to SparseDDP")
        self._drain()
        self._inflight = None if d.get("inflight") is None else StepComm.from_state(d["inflight"])
        self.steps_done = int(d["steps_done"])
        self.skipped_steps = int(d.get("skipped_steps", 0))
        self.planner.load_state_dict(d)
        self._set_groups(d["groups"], migrate=False)
        for r, s in zip(self.reducers, d["reducers"]):
            r.load_state_dict(s)
        if self.policy is not None and d.get("policy") is not None:
            self.policy.load_state_dict(d["policy"])

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        self._worker.close()


def _check_policy(policy):
    """The policy's declared interface (:class:`sparsync.convergence.ConvergencePolicy`), checked once."""
    if policy is None:
        return None
    if not isinstance(policy, ConvergencePolicy):
        raise TypeError(f"policy= needs a sparsync.convergence.ConvergencePolicy (subclass it and override density, "
                        f"before_reduce, after_reduce, state_dict, load_state_dict as needed), got "
                        f"{type(policy).__name__}")
    for cap, v in (("reads_parts", policy.reads_parts), ("folds", policy.folds)):
        if not isinstance(v, bool):
            raise TypeError(f"policy {type(policy).__name__}: {cap} must be a bool, got {v!r}")
    return policy

