"""``sparsync train``: one training configuration on local workers, the emulated cluster, or torchrun.

See ``docs/train.md``. Examples::

    sparsync train --workload digits-mlp --reducer micro --density 0.01 --merge single --workers 4
    sparsync train --workload digits-mlp --reducer dense --bandwidth 1gbit          # root only
    sparsync train --workload lm --reducer s2 --workload-option sparse_embedding=1
    torchrun --nnodes 2 --nproc-per-node 1 ... -m sparsync.cli train --workload digits-mlp ...
"""

from __future__ import annotations

import json
import os
import sys


def parse_kv(items: list[str] | None, what: str) -> dict:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (numbers and true/false parsed)."""
    out = {}
    for it in items or []:
        for part in it.split(","):
            if not part:
                continue
            if "=" not in part:
                from . import UsageError

                raise UsageError(f"{what} must look like key=value, got {part!r}")
            k, v = part.split("=", 1)
            out[k.strip()] = _parse_value(v.strip())
    return out


def _parse_value(v: str):
    low = v.lower()
    if low in ("true", "yes"):
        return True
    if low in ("false", "no"):
        return False
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        return v


def _float_in(lo, hi, what, lo_open=True):
    def conv(s):
        import argparse

        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: expected a number, got {s!r}") from None
        if not ((lo < v if lo_open else lo <= v) and v <= hi):
            raise argparse.ArgumentTypeError(f"{what} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {s!r}")
        return v

    return conv


def add_common(p, compare: bool = False) -> None:
    """Arguments shared by ``train`` and ``compare``."""
    from . import NETWORK, WORKERS, deprecated_alias

    p.add_argument("--workload", default="digits-mlp", help="digits-mlp | digits-cnn | lm | linear")
    p.add_argument("--workers", type=WORKERS, default=4, help="number of data-parallel ranks")
    deprecated_alias(p, "--world-size", "--workers", "workers", WORKERS)
    net = p.add_mutually_exclusive_group()
    net.add_argument("--bandwidth", default=None, metavar="RATE", type=NETWORK,
                     help="run on the emulated cluster with this per-host link rate (root only): 1gbit, 100mbit, "
                          "1Gb/s, 125MB/s; '1gbps' is refused as ambiguous (docs/train.md, Units)")
    net.add_argument("--loopback", action="store_true",
                     help="forked gloo workers over loopback (the default network)")
    net.add_argument("--thread", action="store_true", help=argparse_hidden())
    net.add_argument("--topology", default=None, metavar="SxR",
                     help="emulated cluster of S sites of R ranks (root only), each site its own switch, joined by "
                          "one shaped uplink per site: needs --intra RATE and --inter RATE (docs/cluster.md)")
    p.add_argument("--intra", default=None, metavar="RATE", help="with --topology: each rank's link inside its site")
    p.add_argument("--inter", default=None, metavar="RATE", help="with --topology: each site's uplink")
    p.add_argument("--rate-schedule", default="", metavar="STEP:RATE,...",
                   help="change the emulated inter-host rate mid-run (uplinks with --topology, every host link "
                        "with --bandwidth), e.g. 50:100mbit")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--steps", type=WORKERS, default=None, help="training steps (default: the workload's)")
    steps.add_argument("--epochs", type=_float_in(0, float("inf"), "--epochs"), default=None,
                       help="training epochs instead of --steps")
    p.add_argument("--batch-size", type=WORKERS, default=None, help="per-worker batch size (default: the workload's)")
    p.add_argument("--lr", type=_float_in(0, float("inf"), "--lr"), default=None,
                   help="learning rate (default: the workload's)")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "nesterov", "adam"], default=None,
                   help="(default: the workload's)")
    p.add_argument("--target-accuracy", type=_float_in(0, 1, "--target-accuracy"), default=None,
                   help="for time-to-target (default: the workload's)")
    p.add_argument("--eval-every", type=WORKERS, default=None, help="evaluate every N steps (default: the workload's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and the initial parameters")
    p.add_argument("--workload-option", action="append", metavar="KEY=VALUE",
                   help="workload option, e.g. sparse_embedding=1 or vocab=5000 (repeatable; docs/train.md)")
    p.add_argument("--ddp-option", action="append", metavar="KEY=VALUE",
                   help="extra SparseDDP keyword, e.g. nonfinite=ignore (skips the local NaN/Inf check)")
    conv = p.add_argument_group("convergence at low density (sparse reducers; sparsync.convergence, DGC)")
    conv.add_argument("--momentum-correction", type=float, default=None, metavar="M",
                      help="accumulate momentum M locally before sparsification (the optimizer becomes plain SGD)")
    conv.add_argument("--masking", action=argparse_bool(), default=None,
                      help="momentum-factor masking: clear the velocity of sent entries (default: on with "
                           "--momentum-correction)")
    conv.add_argument("--warmup-steps", type=int, default=None, metavar="T",
                      help="density warm-up: exponential from --warmup-start to --density over T steps")
    conv.add_argument("--warmup-start", type=float, default=None, metavar="S", help="warm-up start density (0.25)")
    conv.add_argument("--nesterov", action=argparse_bool(), default=None,
                      help="Nesterov momentum correction: the reducer is fed g + M u (default: on with "
                           "--optimizer nesterov)")
    conv.add_argument("--local-clip", type=float, default=None, metavar="C",
                      help="clip each rank's gradient to norm C/sqrt(P) before accumulation")
    p.add_argument("--runs-dir", default="runs", help="parent directory of run directories")
    p.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=_float_in(0, float("inf"), "--timeout"), default=900.0,
                   help="seconds before a stuck run is killed")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also log loss, accuracy and step time to a TensorBoard directory (needs the "
                        "tensorboard package: pip install 'sparsync[tensorboard]')")


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def convergence_of(args) -> dict:
    """The GradientPolicy options given by the convergence flags (empty when none)."""
    pairs = (("momentum", "momentum_correction"), ("masking", "masking"), ("warmup_steps", "warmup_steps"),
             ("warmup_start", "warmup_start"), ("clip", "local_clip"), ("nesterov", "nesterov"))
    return {k: getattr(args, a) for k, a in pairs if getattr(args, a, None) is not None}


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def network_of(args) -> str:
    """The run's network as one string: ``thread``, ``loopback``, a rate, or a topology spec
    (``2x2@10gbit/200mbit``, :class:`sparsync.sites.Topology`); UsageError (one line) for bad options."""
    from . import UsageError

    topo, intra, inter = getattr(args, "topology", None), getattr(args, "intra", None), getattr(args, "inter", None)
    if topo is None:
        if intra is not None or inter is not None:
            raise UsageError("--intra / --inter set the rates of a --topology; without one use --bandwidth RATE")
    else:
        from ..sites import Topology

        try:
            t = Topology.parse(topo, intra, inter)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if t.world_size != args.workers:
            raise UsageError(f"--topology {topo} has {t.world_size} ranks but --workers is {args.workers}")
        return t.spec()
    if getattr(args, "thread", False):
        return "thread"
    if args.bandwidth:
        return args.bandwidth
    return "loopback"


def register(sub) -> None:
    from . import DENSITY

    p = sub.add_parser("train", help="train one configuration (writes runs/<name>/)",
                       description="Train one configuration of a workload with a gradient reducer.\n\n" +
                       __doc__.split("\n\n", 2)[2].rstrip())
    add_common(p)
    p.add_argument("--reducer", default="dense",
                   help="a registered reducer (an unknown name lists them) or ddp / ddp-fp16 (torch's DDP)")
    p.add_argument("--density", type=DENSITY, default=0.01, help="fraction of gradient entries sent")
    p.add_argument("--merge", default="single", help="single | wfbp | buckets:<MB> | mgwfbp | optimal")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="reducer option (repeatable; an unknown key lists the reducer's options)")
    p.add_argument("--name", default=None, help="run name (directory <runs-dir>/<name>; default from the config)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                   help="keep the newest N complete checkpoints, delete older ones (0 = keep all)")
    p.add_argument("--resume", action="store_true", help="continue runs/<name> from its latest checkpoint")
    p.set_defaults(func=run)


def config_from_args(args, reducer=None, density=None, merge=None, options=None, name=None, convergence=None):
    from ..train.runs import TrainConfig

    return TrainConfig(
        workload=args.workload, reducer=reducer or args.reducer,
        density=float(density if density is not None else args.density),
        merge=merge or args.merge,
        reducer_options=options if options is not None else parse_kv(args.option, "--option"),
        workload_options=parse_kv(args.workload_option, "--workload-option"),
        ddp_options=parse_kv(getattr(args, "ddp_option", None), "--ddp-option"), workers=args.workers,
        convergence=convergence if convergence is not None else convergence_of(args),
        steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer,
        target_accuracy=args.target_accuracy, eval_every=args.eval_every, seed=args.seed,
        name=name if name is not None else getattr(args, "name", None), runs_dir=args.runs_dir,
        checkpoint_every=getattr(args, "checkpoint_every", 0), network=network_of(args),
        keep_checkpoints=getattr(args, "keep_checkpoints", 2), rate_schedule=getattr(args, "rate_schedule", ""),
        progress=not args.no_progress, timeout=args.timeout)


def _build_reducer_once(cfg) -> None:
    """Construct the run's reducer on rank 0 of a thread world of the run's size, so that option
    *values* (and world-size requirements, e.g. gtopk's power of two) fail here, in one line, instead
    of in every rank after the start. Reducer constructors only validate and store (no collective,
    no gradient-sized allocation: every registered reducer is built this way in tests). Worlds beyond
    the thread cluster's size are not built (the option names were checked already)."""
    from ..reducers.registry import make_reducer
    from ..threadcomm import MAX_THREAD_RANKS, ThreadWorld

    if 1 <= cfg.workers <= MAX_THREAD_RANKS:
        make_reducer(cfg.reducer, ThreadWorld(cfg.workers).comms()[0], density=cfg.density, **cfg.reducer_options)


def preflight(cfg, network: bool = True):
    """Every check that can fail before a rank starts or a directory is created: workload and its
    options, reducer and its options (names against the reducer's signature, values by building it
    once), merge plan, SparseDDP
    keywords, numbers, and (``network=True``) whether the emulated network can run here. Raises
    :class:`~sparsync.commands.UsageError` (one line); returns the built workload (defaults filled in)."""
    import inspect

    from ..schedule.merge import parse_strategy
    from ..train.loop import NetworkUnavailable, check_network, validate
    from ..train.workloads import WORKLOADS
    from . import UsageError

    try:
        if cfg.workload in WORKLOADS:
            valid = [n for n in inspect.signature(WORKLOADS[cfg.workload]).parameters]
            bad = sorted(set(cfg.workload_options) - set(valid))
            if bad:
                raise UsageError(f"workload {cfg.workload!r} has no option {', '.join(bad)}; "
                                 f"valid: {', '.join(valid) or '(none)'}")
        wl = validate(cfg)
        if cfg.is_torch_ddp or cfg.reducer == "nocomm":
            for opt, given in (("--option", cfg.reducer_options), ("--ddp-option", cfg.ddp_options)):
                if given:
                    raise UsageError(f"{opt} {', '.join(given)}: the baseline {cfg.reducer!r} takes no "
                                     "sparsync reducer / SparseDDP options")
        else:
            from ..ddp import SparseDDP
            from ..reducers.registry import load_all

            load_all()[cfg.reducer].check_options(cfg.reducer_options)
            _build_reducer_once(cfg)
            parse_strategy(cfg.merge)
            fixed = {"self", "module", "comm", "reducer", "density", "merge", "reducer_options"}
            valid = [n for n, p in inspect.signature(SparseDDP.__init__).parameters.items()
                     if n not in fixed and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
            bad = sorted(set(cfg.ddp_options) - set(valid))
            if bad:
                raise UsageError(f"--ddp-option {', '.join(bad)}: not a SparseDDP keyword; valid: {', '.join(valid)}")
        if network:
            check_network(cfg.network)
    except UsageError:
        raise
    except (ValueError, TypeError, NetworkUnavailable) as e:
        raise UsageError(str(e).replace("\n", " ")) from None
    return wl


def under_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run(args) -> int:
    from ..train.loop import NetworkUnavailable, launch
    from ..train.runs import CheckpointError, RunExists

    cfg = config_from_args(args)
    if under_torchrun():
        return _run_torchrun(cfg, args)
    wl = preflight(cfg)  # nothing has started and nothing is on disk yet
    tb = tensorboard_tail(getattr(args, "tensorboard", None), [cfg])
    try:
        with tb:
            summary = launch(cfg, force=args.force, resume=args.resume, workload=wl)
    except (ValueError, CheckpointError, RunExists, NetworkUnavailable) as e:
        print(f"sparsync train: error: {e}", file=sys.stderr)
        return 2
    _print_summary(summary, cfg)
    return 0


def tensorboard_tail(logdir, cfgs):
    """A context that mirrors the runs' ``metrics.jsonl`` into TensorBoard while they train
    (:mod:`sparsync.train.tensorboard`); a no-op without ``--tensorboard``."""
    import contextlib

    if not logdir:
        return contextlib.nullcontext()
    from ..train.tensorboard import MetricsTail, require_tensorboard
    from . import UsageError

    try:
        require_tensorboard()
    except ImportError as e:
        raise UsageError(str(e)) from None
    return MetricsTail(logdir, [(cfg.label(), os.path.join(cfg.runs_dir, cfg.name)) for cfg in cfgs])


def _print_summary(s: dict, cfg) -> None:
    tt = s.get("time_to_target_s")
    print(f"{s['label']}: final accuracy {s['final_accuracy']:.4f}, "
          f"time to {s['target_accuracy']:.3f}: {'not reached' if tt is None else f'{tt:.2f} s'}, "
          f"train time {s['train_time_s']:.2f} s, median step {1e3 * (s['median_step_s'] or 0):.1f} ms")
    print(f"run directory: {os.path.join(cfg.runs_dir, cfg.name)}")


def _run_torchrun(cfg, args) -> int:
    """One process of a torchrun job: rank 0 prepares the run directory, every rank trains."""
    import torch.distributed as dist

    from ..launch import comm_from_env, lost_peer_error, peer_table
    from ..train.loop import train_worker
    from ..train.runs import CheckpointError, RunDir, RunExists

    preflight(cfg, network=False)
    comm = comm_from_env("gloo")  # CPU training loop; the library's SparseDDP also runs on NCCL
    if comm.world_size != cfg.workers:
        cfg.workers = comm.world_size  # torchrun decides the world size
    cfg.network = "torchrun"
    path = os.path.join(cfg.runs_dir, cfg.name)
    info = [None]
    if comm.rank == 0:
        resume, force = args.resume, args.force
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            # elastic restart (torchrun --max-restarts): continue this job's run from its latest
            # complete checkpoint, or start it over if it died before the first one (docs/reliability.md)
            resume = RunDir(path).latest_step() is not None
            force = not resume
        try:
            _, resume_info = RunDir.prepare(cfg, force=force, resume=resume)
            info = [json.dumps({"resume": resume_info})]
        except (OSError, CheckpointError, RunExists) as e:  # tell the other ranks, do not leave them waiting
            info = [json.dumps({"error": f"rank 0: {type(e).__name__}: {e}", "kind": type(e).__name__})]
    dist.broadcast_object_list(info, src=0)
    got = json.loads(info[0])
    if "error" in got:
        dist.destroy_process_group()
        raise (RunExists if got["kind"] == "RunExists" else CheckpointError)(got["error"])
    resume_info = got["resume"]
    peers = peer_table(comm)
    try:
        summary = train_worker(comm, cfg.to_dict(), path, resume_info)
    except RuntimeError as e:  # a survivor of a lost rank: name it instead of gloo's peer address
        raise lost_peer_error(e, peers, comm.rank) from e
    if comm.rank == 0:
        RunDir(path).write_summary(summary)
        _print_summary(summary, cfg)
    dist.barrier()
    dist.destroy_process_group()
    return 0
