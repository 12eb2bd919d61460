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
    """argparse type: a finite number in ``(lo, hi]`` (``[lo, hi]`` with ``lo_open=False``)."""
    def conv(s):
        import argparse
        import math

        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: expected a number, got {s!r}") from None
        if not ((lo < v if lo_open else lo <= v) and v <= hi and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"{what} must be a finite number in {'(' if lo_open else '['}{lo:g}, "
                                             f"{hi:g}], got {s!r}")
        return v

    return conv


#: largest seed: every generator seed derived from it (seed * mix + epoch ...) stays inside torch's 64 bits
SEED_MAX = 2**31 - 1
#: largest --timeout / --time-limit in seconds (a year; what torch's collective timeouts can hold)
SECONDS_MAX = 365 * 86400.0


def _int_in(lo, hi, what):
    """argparse type: an integer in ``[lo, hi]`` (``1e3``-style integral numbers accepted)."""
    def conv(s):
        import argparse

        from ..units import parse_count

        try:
            v = parse_count(s) if not str(s).strip().startswith("-") else -parse_count(str(s).strip()[1:])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: expected an integer, got {s!r}") from None
        if not lo <= v <= hi:
            rng = f">= {lo}" if hi >= 2**62 else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{what} must be an integer {rng}, got {s!r}")
        return v

    return conv


SEED = _int_in(0, SEED_MAX, "--seed")


def add_common(p, compare: bool = False) -> None:
    """Arguments shared by ``train`` and ``compare``."""
    from . import NETWORK, WORKERS, deprecated_alias

    p.add_argument("--workload", default="digits-mlp", help="digits-mlp | digits-cnn | lm | gpt | linear")
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
    p.add_argument("--optimizer", choices=["sgd", "momentum", "nesterov", "adam", "adamw"], default=None,
                   help="(default: the workload's)")
    p.add_argument("--weight-decay", type=_float_in(0, float("inf"), "--weight-decay", lo_open=False), default=None,
                   help="weight decay of matrices and embeddings (adamw: decoupled; default: the workload's)")
    p.add_argument("--lr-warmup", type=int, default=None, metavar="STEPS",
                   help="linear learning-rate warm-up steps (default: the workload's)")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default=None,
                   help="after the warm-up: constant, or cosine decay to 0.1 lr (default: the workload's)")
    p.add_argument("--adam-freeze", type=int, default=0, metavar="STEPS",
                   help="adamw: freeze the second moment after STEPS steps, as 1-bit Adam does (0: off)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-accuracy", type=_float_in(0, 1, "--target-accuracy"), default=None,
                        help="for time-to-target: held-out accuracy at or above (default: the workload's)")
    target.add_argument("--target-loss", type=_float_in(0, float("inf"), "--target-loss"), default=None,
                        help="for time-to-target: held-out loss at or below (default: the workload's; gpt)")
    p.add_argument("--eval-every", type=WORKERS, default=None, help="evaluate every N steps (default: the workload's)")
    p.add_argument("--seed", type=SEED, default=0, help=f"seed of the data order and the initial parameters "
                   f"(0 .. {SEED_MAX})")
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
    conv.add_argument("--dense-steps", type=int, default=None, metavar="T",
                      help="send everything (density 1) for the first T steps (1-bit Adam's warm-up stage)")
    conv.add_argument("--nesterov", action=argparse_bool(), default=None,
                      help="Nesterov momentum correction: the reducer is fed g + M u (default: on with "
                           "--optimizer nesterov)")
    conv.add_argument("--local-clip", type=float, default=None, metavar="C",
                      help="clip each rank's gradient to norm C/sqrt(P) before accumulation")
    p.add_argument("--runs-dir", default="runs", help="parent directory of run directories")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing run directory (only one sparsync made, and not while a run uses it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=_float_in(0, SECONDS_MAX, "--timeout"), default=900.0,
                   help="stall timeout: stop the run when no training step completes (and no collective "
                        "answers) for this many seconds; a run that keeps progressing is never stopped by it")
    p.add_argument("--time-limit", type=_float_in(0, SECONDS_MAX, "--time-limit"), default=None, metavar="SECONDS",
                   help="stop the whole run after this many seconds, progressing or not (default: no limit)")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also log loss, accuracy and step time to a TensorBoard directory (needs the "
                        "tensorboard package: pip install 'sparsync[tensorboard]')")


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def convergence_of(args) -> dict:
    """The GradientPolicy options given by the convergence flags (empty when none)."""
    pairs = (("momentum", "momentum_correction"), ("masking", "masking"), ("warmup_steps", "warmup_steps"),
             ("warmup_start", "warmup_start"), ("clip", "local_clip"), ("nesterov", "nesterov"),
             ("dense_steps", "dense_steps"))
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
                   help="a registered reducer (an unknown name lists them), ddp / ddp-fp16 (torch's DDP) or "
                        "ddp-localsgd<H> (torch's post-local SGD)")
    p.add_argument("--density", type=DENSITY, default=0.01, help="fraction of gradient entries sent")
    p.add_argument("--merge", default="single", help="single | wfbp | buckets:<MB> | mgwfbp | optimal")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="reducer option (repeatable; an unknown key lists the reducer's options)")
    local = p.add_argument_group("local steps (docs/localsteps.md)")
    local.add_argument("--sync-every", type=int, default=None, metavar="H",
                       help="DiLoCo: H inner steps per outer synchronisation (the reducer sends the pseudo-gradient)")
    local.add_argument("--outer-lr", type=float, default=None, help="DiLoCo's outer Nesterov SGD lr (0.7)")
    local.add_argument("--outer-momentum", type=float, default=None, help="DiLoCo's outer momentum (0.9)")
    local.add_argument("--local-warmup", type=int, default=None, metavar="N",
                       help="ddp-localsgd<H>: synchronous steps before local SGD (torch's start_localSGD_iter)")
    p.add_argument("--name", default=None, help="run name (directory <runs-dir>/<name>; default from the config)")
    p.add_argument("--checkpoint-every", type=_int_in(0, 2**62, "--checkpoint-every"), default=0,
                   help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=_int_in(0, 2**62, "--keep-checkpoints"), default=2, metavar="N",
                   help="keep the newest N complete checkpoints, delete older ones (0 = keep all)")
    p.add_argument("--resume", action="store_true", help="continue runs/<name> from its latest checkpoint")
    p.set_defaults(func=run)


def config_from_args(args, reducer=None, density=None, merge=None, options=None, name=None, convergence=None):
    from ..train.runs import TrainConfig

    pairs = (("sync_every", "sync_every"), ("outer_lr", "outer_lr"), ("outer_momentum", "outer_momentum"),
             ("warmup", "local_warmup"))
    local_steps = {k: getattr(args, a) for k, a in pairs if getattr(args, a, None) is not None}
    return TrainConfig(local_steps=local_steps,
        workload=args.workload, reducer=reducer or args.reducer,
        density=float(density if density is not None else args.density),
        merge=merge or args.merge,
        reducer_options=options if options is not None else parse_kv(args.option, "--option"),
        workload_options=parse_kv(args.workload_option, "--workload-option"),
        ddp_options=parse_kv(getattr(args, "ddp_option", None), "--ddp-option"), workers=args.workers,
        convergence=convergence if convergence is not None else convergence_of(args),
        steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer,
        target_accuracy=args.target_accuracy, target_loss=getattr(args, "target_loss", None),
        weight_decay=getattr(args, "weight_decay", None), lr_warmup=getattr(args, "lr_warmup", None),
        lr_schedule=getattr(args, "lr_schedule", None), adam_freeze=getattr(args, "adam_freeze", 0) or 0,
        eval_every=args.eval_every, seed=args.seed,
        name=name if name is not None else getattr(args, "name", None), runs_dir=args.runs_dir,
        checkpoint_every=getattr(args, "checkpoint_every", 0), network=network_of(args),
        keep_checkpoints=getattr(args, "keep_checkpoints", 2), rate_schedule=getattr(args, "rate_schedule", ""),
        progress=not args.no_progress, timeout=args.timeout, time_limit=getattr(args, "time_limit", None))


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


def check_workload_options(workload: str, options: dict) -> dict:
    """The workload options with their values checked against the factory's defaults: an integer
    option takes an integer (``1e3`` too), at least 1 (at least 0 where its default is 0: a seed); a
    boolean one true/false/1/0; a float one a finite number. UsageError (one line) otherwise."""
    import inspect
    import math

    from ..train.workloads import WORKLOADS
    from . import UsageError

    params = inspect.signature(WORKLOADS[workload]).parameters
    bad = sorted(set(options) - set(params))
    if bad:
        raise UsageError(f"workload {workload!r} has no option {', '.join(bad)}; "
                         f"valid: {', '.join(params) or '(none)'}")
    out = {}
    for k, v in options.items():
        d = params[k].default
        if isinstance(d, bool):
            if v not in (True, False, 0, 1):
                raise UsageError(f"--workload-option {k}={v!r}: expected true or false")
        elif isinstance(d, int):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
                raise UsageError(f"--workload-option {k}={v!r}: expected an integer")
            lo = 0 if d == 0 else 1
            if v < lo:
                raise UsageError(f"--workload-option {k} must be at least {lo}, got {v!r}")
            v = int(v)
        elif isinstance(d, float) and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise UsageError(f"--workload-option {k}={v!r}: expected a finite number")
        out[k] = v
    return out


def rank_memory_estimate(wl, batch_size: int, seed: int = 0) -> tuple[int, int]:
    """``(bytes, parameters)``: what one rank of this workload holds beyond the interpreter, from
    the model built on the ``meta`` device (shapes only, nothing allocated): 7 float32 words per
    parameter (parameter, gradient, two optimizer moments, the reducer's accumulator and residual,
    the engine's flat gradient), the activations a forward pass of ``batch_size`` samples keeps for
    backward (counted with forward hooks on the meta model) three times (outputs, their gradients,
    temporaries), and the batch itself twice. An estimate to refuse what cannot fit, not a budget."""
    import torch

    try:
        with torch.device("meta"):
            model = wl.build()
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: no estimate (the ranks will say)
        return 0, 0
    params = sum(p.numel() for p in model.parameters())
    x, _ = wl.batch(0, 0, 1, 1, seed)
    acts = [0]

    def count(_m, _i, out):
        if isinstance(out, torch.Tensor):
            acts[0] += out.numel() * out.element_size()

    hooks = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    try:
        model(torch.empty((batch_size, *x.shape[1:]), dtype=x.dtype, device="meta"))
    except Exception:  # noqa: BLE001 - an op without a meta kernel: no activation estimate
        acts[0] = 0
    finally:
        for h in hooks:
            h.remove()
    batch = batch_size * (x[0].numel() * x.element_size() + 8)
    return 28 * params + 3 * acts[0] + 2 * batch, params


def check_resources(cfg, wl) -> None:
    """Refuse (ValueError, one line) a run this machine cannot hold: the ranks it runs here (all of
    them on a local network, this process under torchrun) against memory, and local process ranks
    against file descriptors, processes and cores (:func:`sparsync.launch.check_local_workers`)."""
    from ..launch import RANK_MEMORY, check_local_workers, format_bytes

    per, params = rank_memory_estimate(wl, cfg.batch_size, cfg.seed)
    hint = (f"a rank holds ~{format_bytes(per)} for the model ({params:,} parameters) and a batch of "
            f"{cfg.batch_size}: lower --batch-size, the model's size (--workload-option) or --workers")
    if cfg.network == "torchrun":
        check_local_workers(1, RANK_MEMORY + per, what="this torchrun worker", processes=False, hint=hint)
    else:
        check_local_workers(cfg.workers, RANK_MEMORY + per, processes=cfg.network != "thread", hint=hint)


def _check_ddp_option_values(cfg) -> None:
    """Build a SparseDDP of a tiny module on a one-rank thread world with the run's SparseDDP keywords
    (dense reducer: its own options are checked apart), so their values fail here, not in the ranks."""
    from torch import nn

    from ..ddp import SparseDDP
    from ..threadcomm import ThreadWorld

    ddp = SparseDDP(nn.Linear(2, 2), ThreadWorld(1).comms()[0], reducer="dense", **cfg.ddp_options)
    close = getattr(ddp, "close", None)
    if callable(close):
        close()


def preflight(cfg, network: bool = True):
    """Every check that can fail before a rank starts or a directory is created: workload and its
    options (names and values), reducer and its options (names against the reducer's signature,
    values by building it once), merge plan, SparseDDP keywords and their values, numbers, the run
    name, the emulated network's rate, memory and local ranks (:func:`check_resources`), and
    (``network=True``) whether the emulated network can run here. Raises
    :class:`~sparsync.commands.UsageError` (one line); returns the built workload (defaults filled in)."""
    import inspect

    from ..schedule.merge import parse_strategy
    from ..train.loop import NetworkUnavailable, check_network, validate
    from ..train.runs import check_run_name
    from ..train.workloads import WORKLOADS
    from . import UsageError

    try:
        if cfg.workload in WORKLOADS:
            cfg.workload_options = check_workload_options(cfg.workload, cfg.workload_options)
        if cfg.name is not None:
            check_run_name(cfg.name)
        if cfg.network not in ("loopback", "thread", "torchrun"):
            from ..cluster import link_bandwidth

            link_bandwidth(cfg.network)
        wl = validate(cfg)
        check_run_name(cfg.name)  # the default name too
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
            if cfg.ddp_options:
                try:
                    _check_ddp_option_values(cfg)
                except (ValueError, TypeError) as e:
                    raise UsageError(f"--ddp-option: {str(e).splitlines()[0]}") from None
        if cfg.checkpoint_every < 0:
            raise UsageError(f"--checkpoint-every must be >= 0 (0: only at the end), got {cfg.checkpoint_every}")
        check_resources(cfg, wl)
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
    ppl = "" if s.get("final_perplexity") is None else f" (perplexity {s['final_perplexity']:.2f})"
    print(f"{s['label']}: final accuracy {s['final_accuracy']:.4f}, final held-out loss {s['final_test_loss']:.4f}"
          f"{ppl}, time to {cfg.target_text()}: {'not reached' if tt is None else f'{tt:.2f} s'}, "
          f"train time {s['train_time_s']:.2f} s, median step {1e3 * (s['median_step_s'] or 0):.1f} ms")
    print(f"run directory: {os.path.join(cfg.runs_dir, cfg.name)}")


def _run_torchrun(cfg, args) -> int:
    """One process of a torchrun job: rank 0 prepares the run directory, every rank trains."""
    import torch.distributed as dist

    from ..launch import comm_from_env, lost_peer_error, peer_table
    from ..train.loop import train_worker
    from ..train.runs import CheckpointError, RunDir, RunExists, run_job

    cfg.network = "torchrun"
    preflight(cfg, network=False)
    comm = comm_from_env("gloo")  # CPU training loop; the library's SparseDDP also runs on NCCL
    if comm.world_size != cfg.workers:
        cfg.workers = comm.world_size  # torchrun decides the world size
    path = os.path.join(cfg.runs_dir, cfg.name)
    info = [None]
    rd = None
    if comm.rank == 0:
        resume, force, job = args.resume, args.force, torchrun_job()
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 and run_job(path) == job:
            # elastic restart (torchrun --max-restarts) of a run THIS job created: continue it from its
            # latest complete checkpoint, or start it over if it died before the first one
            # (docs/reliability.md). Any other directory gets what the first attempt got: a refusal stays one.
            resume = RunDir(path).latest_step() is not None
            force = not resume
        try:
            rd, resume_info = RunDir.prepare(cfg, force=force, resume=resume, job=job)  # locked until the end
            info = [json.dumps({"resume": resume_info})]
        except (OSError, CheckpointError, RunExists) as e:  # tell the other ranks, do not leave them waiting
            info = [json.dumps({"error": f"rank 0: {type(e).__name__}: {e}", "kind": type(e).__name__})]
    dist.broadcast_object_list(info, src=0)
    got = json.loads(info[0])
    if "error" in got:
        dist.destroy_process_group()
        raise (RunExists if got["kind"] in ("RunExists", "RunBusy") else CheckpointError)(got["error"])
    resume_info = got["resume"]
    peers = peer_table(comm)
    try:
        summary = train_worker(comm, cfg.to_dict(), path, resume_info)
    except RuntimeError as e:  # a survivor of a lost rank: name it instead of gloo's peer address
        raise lost_peer_error(e, peers, comm.rank) from e
    if comm.rank == 0:
        rd.write_summary(summary)
        _print_summary(summary, cfg)
    dist.barrier()
    dist.destroy_process_group()
    if rd is not None:
        rd.release()
    return 0


def torchrun_job() -> str:
    """This torchrun job's identity, the same in every restart of it: the rendezvous id when one was
    given, else the agent (this worker's parent) on this host."""
    import socket

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    return f"torchrun:{socket.gethostname()}:{os.getppid()}"
