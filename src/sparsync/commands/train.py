"""``sparsync train``: one training configuration on local workers, the emulated cluster, or torchrun.

See ``docs/train.md``. Examples::

    sparsync train --workload digits-mlp --reducer micro --density 0.01 --merge single --workers 4
    sparsync train --workload digits-mlp --reducer dense --bandwidth 1gbit          # root only
    sparsync train --workload lm --reducer s2 --workload-option sparse_embedding=1
    torchrun --nnodes 2 --nproc-per-node 1 ... -m sparsync.cli train --workload digits-mlp ...
"""

from __future__ import annotations

import os
import sys

from . import SECONDS_MAX, SEED, SEED_MAX, float_in, int_in, parse_kv, parse_value
from ._preflight import check_resources, check_workload_options, preflight, rank_memory_estimate
from ._summary import print_summary
from ._torchrun import run_torchrun as _run_torchrun
from ._torchrun import torchrun_job, under_torchrun
from ._train_args import add_common, argparse_bool, argparse_hidden, config_from_args, convergence_of, network_of

# The options ``train`` shares with ``compare``, the checks before a run, a torchrun process and the summary
# printed at the end live in ``_train_args``, ``_preflight``, ``_torchrun`` and ``_summary`` of this package;
# their names stay importable from here.
__all__ = ["SECONDS_MAX", "SEED", "SEED_MAX", "add_common", "argparse_bool", "argparse_hidden", "check_resources",
           "check_workload_options", "config_from_args", "convergence_of", "float_in", "int_in", "network_of",
           "parse_kv", "parse_value", "preflight", "rank_memory_estimate", "register", "run", "tensorboard_tail",
           "torchrun_job", "under_torchrun"]
#: earlier spellings, still imported by other subcommands
_float_in, _int_in, _parse_value = float_in, int_in, parse_value


def _period(text: str):
    """``--sync-every``: a positive integer or ``auto``."""
    if text == "auto":
        return text
    return int_in(1, 2**31, "--sync-every")(text)


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
    local.add_argument("--sync-every", type=_period, default=None, metavar="H",
                       help="DiLoCo: H inner steps per outer synchronisation (the reducer sends the pseudo-gradient); "
                            "auto: chosen from the measured step and synchronisation times")
    local.add_argument("--outer", choices=["nesterov", "sgd", "adam"], default=None,
                       help="DiLoCo's outer optimizer (default nesterov: Nesterov SGD; adam needs --outer-lr)")
    local.add_argument("--outer-lr", type=float, default=None, help="DiLoCo's outer lr (0.7 for SGD)")
    local.add_argument("--outer-momentum", type=float, default=None,
                       help="DiLoCo's outer momentum (0.9; Adam's beta1 with --outer adam)")
    local.add_argument("--overlap", type=int_in(0, 2**31, "--overlap"), default=None, metavar="TAU",
                       help="DiLoCo: the exchange runs beside the next TAU inner steps (1..H; default 0: waited for)")
    local.add_argument("--local-warmup", type=int, default=None, metavar="N",
                       help="ddp-localsgd<H>: synchronous steps before local SGD (torch's start_localSGD_iter)")
    p.add_argument("--name", default=None, help="run name (directory <runs-dir>/<name>; default from the config)")
    p.add_argument("--checkpoint-every", type=int_in(0, 2**62, "--checkpoint-every"), default=0,
                   help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int_in(0, 2**62, "--keep-checkpoints"), default=2, metavar="N",
                   help="keep the newest N complete checkpoints, delete older ones (0 = keep all)")
    p.add_argument("--resume", action="store_true", help="continue runs/<name> from its latest checkpoint")
    p.set_defaults(func=run)


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
    print_summary(summary, cfg)
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

