"""The training options ``sparsync train`` and ``sparsync compare`` share (:func:`add_common`), and
what the parsed options mean: the run's network (:func:`network_of`), its convergence policy
(:func:`convergence_of`) and the :class:`~sparsync.train.runs.TrainConfig` they make
(:func:`config_from_args`).

Nothing here imports torch: ``sparsync --help`` builds every parser without it.
"""

from __future__ import annotations

from . import SECONDS_MAX, SEED, SEED_MAX, float_in, parse_kv

__all__ = ["add_common", "argparse_bool", "argparse_hidden", "config_from_args", "convergence_of", "network_of"]


def add_common(p, compare: bool = False) -> None:
    """Arguments shared by ``train`` and ``compare``."""
    from . import NETWORK, WORKERS, deprecated_alias

    p.add_argument("--workload", default="digits-mlp", help="digits-mlp | digits-cnn | lm | gpt | gpt-long | linear")
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
    steps.add_argument("--epochs", type=float_in(0, float("inf"), "--epochs"), default=None,
                       help="training epochs instead of --steps")
    p.add_argument("--batch-size", type=WORKERS, default=None, help="per-worker batch size (default: the workload's)")
    p.add_argument("--lr", type=float_in(0, float("inf"), "--lr"), default=None,
                   help="learning rate (default: the workload's)")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "nesterov", "adam", "adamw"], default=None,
                   help="(default: the workload's)")
    p.add_argument("--weight-decay", type=float_in(0, float("inf"), "--weight-decay", lo_open=False), default=None,
                   help="weight decay of matrices and embeddings (adamw: decoupled; default: the workload's)")
    p.add_argument("--lr-warmup", type=int, default=None, metavar="STEPS",
                   help="linear learning-rate warm-up steps (default: the workload's)")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default=None,
                   help="after the warm-up: constant, or cosine decay to 0.1 lr (default: the workload's)")
    p.add_argument("--adam-freeze", type=int, default=0, metavar="STEPS",
                   help="adamw: freeze the second moment after STEPS steps, as 1-bit Adam does (0: off)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-accuracy", type=float_in(0, 1, "--target-accuracy"), default=None,
                        help="for time-to-target: held-out accuracy at or above (default: the workload's)")
    target.add_argument("--target-loss", type=float_in(0, float("inf"), "--target-loss"), default=None,
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
    p.add_argument("--timeout", type=float_in(0, SECONDS_MAX, "--timeout"), default=900.0,
                   help="stall timeout: stop the run when no training step completes (and no collective "
                        "answers) for this many seconds; a run that keeps progressing is never stopped by it")
    p.add_argument("--time-limit", type=float_in(0, SECONDS_MAX, "--time-limit"), default=None, metavar="SECONDS",
                   help="stop the whole run after this many seconds, progressing or not (default: no limit)")
    p.add_argument("--stop-at-target", action="store_true",
                   help="end each run at the first evaluation that reaches the target (time to target "
                        "unchanged; final numbers are then those at the target)")
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


def config_from_args(args, reducer=None, density=None, merge=None, options=None, name=None, convergence=None):
    from ..train.runs import TrainConfig

    pairs = (("sync_every", "sync_every"), ("outer", "outer"), ("outer_lr", "outer_lr"),
             ("outer_momentum", "outer_momentum"), ("overlap", "overlap"), ("warmup", "local_warmup"))
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
        progress=not args.no_progress, timeout=args.timeout, time_limit=getattr(args, "time_limit", None),
        stop_at_target=bool(getattr(args, "stop_at_target", False)))
