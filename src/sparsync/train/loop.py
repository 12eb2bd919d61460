"""The training loop every rank runs, and the launcher that starts the ranks.

``launch(cfg)`` validates the configuration (workload, reducer, network:
:mod:`sparsync.train.validation`), prepares the run directory (:mod:`sparsync.train.runs`), then
starts ``cfg.workers`` ranks:

* ``network="loopback"``: forked gloo processes on this machine (``run_local(..., backend="gloo")``);
* ``network="1gbit"`` (any ``tc`` rate such as ``100mbit``): one network namespace per rank with a
  rate-limited veth (:func:`sparsync.cluster.run_emulated`; needs root);
* ``network="thread"``: in-process ranks on a :class:`~sparsync.threadcomm.ThreadComm` (tests; no
  torch DDP there);
* under ``torchrun`` the CLI calls :func:`train_worker` directly in every process
  (:func:`sparsync.launch.comm_from_env`, env:// rendezvous).

Each rank: seeds torch, builds the workload and the model (identical initial parameters on every
rank), wraps it in :class:`sparsync.ddp.SparseDDP` (``reducer`` any registered reducer) or in
torch's own ``DistributedDataParallel`` (``reducer="ddp"``; ``"ddp-fp16"`` adds torch's
``fp16_compress_hook``), and runs ``cfg.steps`` steps of forward / backward / optimizer on its shard
of a deterministic global batch (:meth:`Workload.batch_indices`). Rank 0 appends one JSON line per
step to ``metrics.jsonl``: loss, wall time split (forward, backward, optimizer; and from the engine
select / comm / wait / backward-compute), bytes sent and received, achieved density; every
``eval_every`` steps the held-out accuracy and loss (rank 0 evaluates, every rank receives its numbers:
:func:`sparsync.train.clock.evaluate_once`; evaluation time is excluded from the wall-clock, and that
exchange is an untimed meeting, so the next step starts as after any other step). Time and steps to
target are interpolated between the evaluations on either side of the crossing
(:func:`sparsync.train.stats.crossing`; the target is on accuracy, or on the metric a configuration's
``target_metric`` names); the run's final numbers are :func:`sparsync.train.summary.summarize`.

``stop_at_target`` (``--stop-at-target``) ends the run at the first evaluation that reaches the
target: every rank holds rank 0's evaluation, so every rank stops at the same step; the summary's
``stopped_at_target`` is the number of steps run.

Resume: every rank saves model, optimizer, engine (reducer residuals etc.) and the loop's counters;
since data depend only on (seed, step), a resumed run reproduces the uninterrupted one's losses
bitwise (tested in ``tests/train/test_train_resume.py``).
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import torch
from torch import nn

from ..launch import progress
from .optim import make_optimizer, set_lr
from .runs import RunDir, TrainConfig, load_checkpoint, save_checkpoint
from .summary import _auto_summary, _reached, summarize, target_of  # noqa: F401
from .validation import (NOCOMM, TORCH_DDP, NetworkUnavailable, check_network, policy_options, valid_reducers,
                         validate)
from .validation import _check_rate_schedule, _validate_optimizer  # noqa: F401
from .workloads import make_workload

# validation and summary live in their own modules; their names stay importable from here
__all__ = ["NOCOMM", "TORCH_DDP", "NetworkUnavailable", "check_network", "launch", "policy_options", "summarize",
           "target_of", "train_worker", "valid_reducers", "validate"]

#: the engine's step breakdown (``last_stats``, :mod:`sparsync.schedule.stepstats`) kept per step
_BREAKDOWN_KEYS = ("writeback_s", "copy_s", "check_s", "policy_s", "reducer_other_s", "cpu_wait_s",
                   "wait_copy_s", "wait_check_s", "wait_policy_s", "wait_select_s", "wait_comm_s",
                   "wait_reducer_other_s", "wait_idle_s")

_INIT_LOCK = threading.Lock()


def launch(cfg: TrainConfig, force: bool = False, resume: bool = False, workload=None,
           record: dict | None = None) -> dict:
    """Validate, prepare ``runs/<name>``, run every rank; returns the summary, also written to
    summary.json - with ``record``'s fields added (a comparison's row), once, before the run's lock is
    released: no reader sees a summary without them, no other writer comes in between."""
    if workload is None:
        validate(cfg)
    check_network(cfg.network)
    from .. import native

    native.enabled()  # build (first use: ~0.2 s alone, seconds with 4 ranks at once) or load the C kernels
    #                   here, once, not inside the first timed step of every rank
    rd, info = RunDir.prepare(cfg, force=force, resume=resume)  # locked until the run ends
    args = (cfg.to_dict(), str(rd.path), info)
    P = cfg.workers
    limits = {"timeout": cfg.timeout, "time_limit": cfg.time_limit}
    try:
        if cfg.network == "thread":
            from ..launch import run_local

            results = run_local(train_worker, P, *args, backend="thread", **limits)
        elif cfg.network == "loopback":
            from ..launch import run_local

            results = run_local(train_worker, P, *args, backend="gloo", env=rank_env(cfg), **limits)
        else:
            from ..cluster import run_emulated

            results = run_emulated(train_worker, P, *args, bandwidth=cfg.network, env=rank_env(cfg), **limits)
        summary = results[0]
        keys = ("median_step_s", "median_compute_s", "median_select_s", "median_comm_s", "median_wait_s",
                "mean_select_s")
        summary["per_rank"] = [{k: r.get(k) for k in keys} for r in results]  # rank 0's view is not everyone's
        summary.update(record or {})
        rd.write_summary(summary)
    except BaseException:
        rd.remove_incomplete()  # every rank is gone: only complete checkpoints stay on disk
        raise
    finally:
        rd.release()
    return summary


# ---------------------------------------------------------------------------- one rank
def _wrap(cfg: TrainConfig, model: nn.Module, comm):
    """(callable model, engine or None). Engine = SparseDDP or torch DDP; None for the floor and for
    local steps (:func:`sparsync.localsteps.trainer.wrap` builds theirs with the optimizer)."""
    from ..localsteps.trainer import is_local

    if cfg.reducer == NOCOMM or is_local(cfg):
        return model, None
    if cfg.is_torch_ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        kw = {}
        if cfg.reducer.startswith("ddp-powersgd"):  # one bucket: see _powersgd_state
            kw["bucket_cap_mb"] = 1 + sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        ddp = DDP(model, process_group=getattr(comm, "group", None), **kw)
        if cfg.reducer == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            ddp.register_comm_hook(getattr(comm, "group", None), fp16_compress_hook)
        elif cfg.reducer.startswith("ddp-powersgd"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            ddp.register_comm_hook(_powersgd_state(cfg, comm, psgd), psgd.powerSGD_hook)
        return ddp, ddp
    from ..ddp import SparseDDP

    kw = dict(cfg.ddp_options)
    if cfg.convergence:
        from ..convergence import policy_from_options

        kw["policy"] = policy_from_options(policy_options(cfg))
    options = dict(cfg.reducer_options)
    if cfg.reducer == "auto" and cfg.optimizer in ("adam", "adamw"):
        from ..autotune.candidates import for_adaptive_optimizer

        options = for_adaptive_optimizer(options)  # sparse per-step candidates do not converge under Adam
    ddp = SparseDDP(model, comm, reducer=cfg.reducer, density=cfg.density, merge=cfg.merge,
                    reducer_options=options, **kw)
    fwd = ddp if callable(ddp) else model
    return fwd, ddp


def rank_env(cfg: TrainConfig) -> dict | None:
    """Environment of the row's rank processes: torch's ``powerSGD_hook`` calls
    ``torch.cuda.synchronize(device)`` whenever CUDA is available, which fails for the CPU gradients
    these workloads train on, so PowerSGD rows run with the GPUs hidden (``CUDA_VISIBLE_DEVICES``
    empty; the rows train on the CPU either way). None for every other row."""
    return {"CUDA_VISIBLE_DEVICES": ""} if cfg.reducer.startswith("ddp-powersgd") else None


def _powersgd_state(cfg: TrainConfig, comm, psgd):
    """torch's own PowerSGDState (error feedback and warm start on, its defaults) at the row's rank.

    ``start_powerSGD_iter=2``: the smallest torch allows with error feedback / warm start (its
    default, 1000, would make a 100-step run plain all-reduce throughout). ``random_seed`` fixed, so
    every rank draws the same initial Q (torch requires that).

    Why DDP gets ONE bucket here: ``powerSGD_hook`` issues its second and third all-reduce (P, then
    Q) from ``Future.then`` callbacks, which gloo runs on its own thread when the previous
    all-reduce completes. With several buckets, the next bucket's hook meanwhile issues its first
    all-reduce from the autograd thread, so the order of collectives on the process group differs
    between ranks: gloo pairs messages of different collectives and aborts ("op.preamble.length <=
    op.nbytes ... Received data size doesn't match expected size"; measured with torch's default
    buckets, 2 ranks, digits MLP), or would hang where sizes happen to agree. One bucket leaves a
    single chain of collectives per step, the same on every rank (``merge="single"`` on our side).
    """
    rank = int(cfg.reducer.removeprefix("ddp-powersgd"))
    return psgd.PowerSGDState(process_group=getattr(comm, "group", None), matrix_approximation_rank=rank,
                              start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                              random_seed=cfg.seed)


def _ddp_bytes(cfg: TrainConfig, model: nn.Module) -> int:
    """Ring all-reduce bytes per rank for torch DDP (gloo ring): 2(P-1)/P * values * value bytes.

    PowerSGD (steady state, after ``start_powerSGD_iter``): a tensor viewed as an ``n x m`` matrix
    is compressed when ``(n + m) r * 2 < n m`` (torch's ``min_compression_rate=2``) and then sends P
    (``n x r``) and Q (``m x r``); 1-D tensors and the others go uncompressed.
    """
    P = cfg.workers
    if P == 1:
        return 0
    values, vb = 0, 4
    if cfg.reducer.startswith("ddp-powersgd"):
        r = int(cfg.reducer.removeprefix("ddp-powersgd"))
        for p in model.parameters():
            n, m = (p.shape[0], p.numel() // p.shape[0]) if p.dim() > 1 else (p.numel(), 1)
            values += (n + m) * r if p.dim() > 1 and (n + m) * r * 2 < n * m else p.numel()
    else:
        values = sum(p.numel() for p in model.parameters())
        vb = 2 if cfg.reducer == "ddp-fp16" else 4
    return int(2 * (P - 1) * values * vb // P)


def _rate_schedule(cfg: TrainConfig, start: int) -> dict:
    """{step: bits/s} of ``--rate-schedule``; on resume the latest change before ``start`` applies at it."""
    if not cfg.rate_schedule:
        return {}
    from ..cluster import parse_rate_schedule

    sched = parse_rate_schedule(cfg.rate_schedule)
    earlier = [k for k in sched if k < start]
    if earlier and start not in sched:
        sched[start] = sched[max(earlier)]
    return sched


def train_worker(comm, cfg_dict: dict, run_path: str | None, resume_info: dict | None,
                 record_losses: bool = True) -> dict:
    """Run one rank of a training run; rank 0 writes metrics. Returns a summary dict (with the
    per-step losses and eval accuracies when ``record_losses``, used by the resume tests).

    One function of about 130 lines, on purpose: the loop reads top to bottom, and its running state
    (train time, evaluations, time to target) is shared with the checkpoint closure."""
    from ..localsteps import trainer as local
    from . import clock

    cfg = TrainConfig.from_dict(cfg_dict)
    rank, P = comm.rank, comm.world_size
    if P != cfg.workers:
        raise ValueError(f"config asks for {cfg.workers} workers but the group has {P}")
    wl = make_workload(cfg.workload, **cfg.workload_options)
    cfg.fill_defaults(wl)
    # thread ranks share torch's global RNG: same initial parameters on every rank; fork_rng gives the
    # caller its RNG state back (module init draws from the global RNG, no Generator argument)
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = wl.build()
    numel = sum(p.numel() for p in model.parameters())
    fwd, ddp = _wrap(cfg, model, comm)
    opt = make_optimizer(cfg, model.parameters())
    if local.is_local(cfg):  # DiLoCo / torch's post-local SGD wrap the optimizer
        fwd, ddp, opt = local.wrap(cfg, model, comm, opt)
    rd = RunDir(run_path) if run_path else None

    start, train_time, evals, time_to_target = _resume(resume_info, cfg, rank, model, opt, ddp)
    allreduce_s = clock.time_allreduce(comm, numel)  # the link ratio's numerator (untimed, unrecorded)
    local_steps = local.is_local(cfg)

    def checkpoint(step):
        if rd is None:
            return
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "engine": ddp.sparsync_state_dict() if (ddp is not None and not cfg.is_torch_ddp) else None,
                 "loop": {"train_time": train_time, "evals": evals, "time_to_target": time_to_target}}
        save_checkpoint(rd.ckpt_dir(step) / f"rank{rank}.pt", cfg, rank, step, state)
        comm.barrier()
        if rank == 0:
            rd.mark_latest(step, keep=cfg.keep_checkpoints)

    metrics_f = rd.metrics_writer() if (rd is not None and rank == 0) else None
    bar = _progress_bar(cfg, start) if (cfg.progress and rank == 0) else None
    losses, rows = [], []
    comm.barrier()
    last_acc = evals[-1]["accuracy"] if evals else None
    rates = _rate_schedule(cfg, start)
    stop, end = False, cfg.steps
    try:
        for step in range(start, cfg.steps):
            if step in rates:  # the emulated inter-host links change rate before this step (a collective)
                from ..cluster import change_rate

                change_rate(comm, rates[step])
            x, y = wl.batch(step, rank, P, cfg.batch_size, cfg.seed)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            set_lr(opt, cfg, step)
            out = fwd(x)
            loss = wl.loss_fn(out, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            step_s = t3 - t0
            train_time += step_s
            lv = float(loss.detach())
            if not math.isfinite(lv):
                raise FloatingPointError(f"loss became {lv} at step {step}; lower --lr or check the reducer")
            rec = _step_record(cfg, model, ddp, numel, step, lv, train_time, (t0, t1, t2, t3))
            if step in rates:
                rec["inter_rate_bits"] = rates[step]  # the emulated rate changed before this step
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                train_time = rec["time_s"] = clock.slowest(comm, train_time)  # the slowest rank's clock
                in_sync = getattr(ddp, "in_sync", False)  # DiLoCo right after a blocking synchronisation
                ev = clock.evaluate_once(wl, clock.kept_model(model, comm, local_steps, in_sync), comm)
                rec["accuracy"], rec["test_loss"] = ev["accuracy"], ev["loss"]
                if "perplexity" in ev:
                    rec["perplexity"] = ev["perplexity"]
                evals.append({"step": step, "time_s": train_time, **ev})
                last_acc = ev["accuracy"]
                if time_to_target is None and _reached(cfg, ev):
                    time_to_target = train_time
                # untimed: every rank starts the next step together (evaluate_once ends in a meeting),
                # as after any step (else the others would compute it while rank 0 evaluates: steps
                # after an evaluation would look faster). Every rank holds rank 0's evaluation, so
                # with stop_at_target every rank stops at the same step.
                stop = cfg.stop_at_target and time_to_target is not None
            losses.append(lv)
            rows.append(rec)
            if metrics_f is not None:
                metrics_f.write(rec)
            if bar is not None:
                bar.set_postfix(_progress_fields(rec, last_acc), refresh=False)
                bar.update(1)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                checkpoint(step + 1)
            progress()  # the stall timeout counts from here (sparsync.launch.run_local)
            if stop:
                end = step + 1
                break
    except BaseException:
        _close(ddp)
        raise
    finally:
        if bar is not None:
            bar.close()
        if metrics_f is not None:
            metrics_f.close()
    if cfg.final_checkpoint and end > start:  # a checkpoint is named by the step whose state it holds
        checkpoint(end)
    flush = getattr(ddp, "flush", None)  # DiLoCo with overlap: no exchange left in flight at exit
    if callable(flush):
        flush()
    _close(ddp)
    summary = summarize(cfg, rows if rd is None else RunDir(run_path).metrics() if rank == 0 else rows,
                        evals, time_to_target, train_time, numel, n_heldout=int(wl.y_test.shape[0]))
    summary["stopped_at_target"] = end if stop else None  # the step count run, when the target ended it
    summary.update(allreduce_s=allreduce_s, steps_run=end,
                   link_ratio=clock.link_ratio(allreduce_s, summary["median_compute_s"]),
                   utilisation=clock.utilisation(summary["median_compute_s"], train_time / max(1, end)))
    if record_losses:
        summary["losses"] = losses
    return summary


def _resume(resume_info, cfg, rank, model, opt, ddp):
    """``(start step, train time, evals, time to target)``: zeros for a new run, else the
    checkpoint's loop state after loading model, optimizer and SparseDDP state from it."""
    if not resume_info:
        return 0, 0.0, [], None
    blob = load_checkpoint(Path(resume_info["dir"]) / f"rank{rank}.pt", cfg, rank)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    if blob.get("engine") is not None and hasattr(ddp, "load_state_dict") and not cfg.is_torch_ddp:
        ddp.load_sparsync_state_dict(blob["engine"])
    loop = blob["loop"]
    return int(blob["step"]), float(loop["train_time"]), list(loop["evals"]), loop["time_to_target"]


def _progress_bar(cfg, start: int):
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc=cfg.label(), unit="step", leave=True, dynamic_ncols=True)


def _step_record(cfg, model, ddp, numel, step, loss, train_time, times) -> dict:
    """One line of ``metrics.jsonl``: the trainer's clock (``times`` = start, end of forward, end of
    backward, end of the optimizer step) and, for SparseDDP, the engine's step breakdown."""
    t0, t1, t2, t3 = times
    rec = {"step": step, "loss": loss, "time_s": train_time, "step_s": t3 - t0, "forward_s": t1 - t0,
           "backward_s": t2 - t1, "optimizer_s": t3 - t2}
    if cfg.is_torch_ddp:
        from ..localsteps.trainer import step_bytes

        nb = step_bytes(cfg, numel, step)  # post-local SGD: only warm-up and averaging steps send
        nb = _ddp_bytes(cfg, model) if nb is None else nb
        rec.update(bytes_sent=nb, bytes_received=nb, density=1.0 if nb else 0.0, selected=numel if nb else 0,
                   numel=numel, compute_s=None)
        return rec
    st = dict(getattr(ddp, "last_stats", {}) or {})
    for k in ("select_s", "comm_s", "wait_s", "bytes_sent", "bytes_received", "selected", "intra_bytes", "inter_bytes",
              "numel", "density", "groups", "outer_s", "sync_every", *_BREAKDOWN_KEYS,
              *(k for k in st if k.startswith("reducer_") and k not in _BREAKDOWN_KEYS)):
        if k in st:
            v = st[k]
            if not (isinstance(v, (int, float)) or v is None):
                v = len(v) if hasattr(v, "__len__") else str(v)
            rec[k] = v
    if st.get("auto"):  # reducer="auto": the choice per group; a decision (its reason and scores) when one was made
        rec["auto_choice"] = ";".join(str(a.get("choice")) for a in st["auto"])
        made = [{"group": a["group"], **a["decision"]} for a in st["auto"] if a.get("decision")]
        if made:
            rec["auto_decisions"] = made
    bc = st.get("backward_s")
    rec["backward_compute_s"] = bc
    rec["compute_s"] = (t1 - t0) + (t3 - t2) + (bc if bc is not None else (t2 - t1)) - (st.get("outer_s") or 0.0)
    return rec


def _progress_fields(rec: dict, last_acc) -> dict:
    """The progress bar's postfix for one step."""
    post = {"loss": f"{rec['loss']:.3f}", "acc": "-" if last_acc is None else f"{last_acc:.3f}",
            "step_ms": f"{1e3 * rec['step_s']:.0f}"}
    if "comm_s" in rec:
        post.update(sel_ms=f"{1e3 * rec.get('select_s', 0):.0f}", comm_ms=f"{1e3 * rec['comm_s']:.0f}",
                    wait_ms=f"{1e3 * rec.get('wait_s', 0) or 0:.0f}")
    return post


def _close(ddp) -> None:
    close = getattr(ddp, "close", None)
    if callable(close):
        close()
