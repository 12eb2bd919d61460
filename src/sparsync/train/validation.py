"""What ``sparsync train`` checks before any process starts: names and numbers of a
:class:`~sparsync.train.runs.TrainConfig` (:func:`validate`, one line per problem, returning the built
workload), whether the emulated network can run here (:func:`check_network`), and the convergence
options a run uses (:func:`policy_options`). The baselines beside the registered reducers are
:data:`TORCH_DDP` (torch's own DDP and its communication hooks) and :data:`NOCOMM` (the
no-communication floor)."""

from __future__ import annotations

import os

from .optim import OPTIMIZERS, SCHEDULES
from .runs import TrainConfig
from .workloads import make_workload, workload_names

__all__ = ["NOCOMM", "TORCH_DDP", "NetworkUnavailable", "check_network", "policy_options", "valid_reducers",
           "validate"]

#: torch's own DDP: plain, fp16 compression hook, PowerSGD hook of rank 1 and 4 (torch's PowerSGDState)
TORCH_DDP = ("ddp", "ddp-fp16", "ddp-powersgd1", "ddp-powersgd4")
#: the no-communication floor: same model and data, gradients never exchanged (ranks drift apart;
#: its accuracy is rank 0's local model). Every other step time is divided by its step time.
NOCOMM = "nocomm"


class NetworkUnavailable(RuntimeError):
    """The emulated network cannot be used here (not root, or sparsync.cluster missing)."""


def valid_reducers() -> list[str]:
    from ..reducers.registry import load_all

    return sorted(load_all()) + list(TORCH_DDP) + [NOCOMM]


def validate(cfg: TrainConfig):
    """Check names and numbers before any process starts; returns the built workload."""
    if cfg.workload not in workload_names():
        raise ValueError(f"unknown workload {cfg.workload!r}; valid: {', '.join(workload_names())}")
    from ..localsteps import trainer as local

    reducers = valid_reducers()
    # a DiLoCo row (local_steps) names a registered reducer too; only torch's ddp-localsgd<H> is not one
    if cfg.reducer not in reducers and not (local.is_local(cfg) and not local.is_diloco(cfg)):
        raise ValueError(f"unknown reducer {cfg.reducer!r}; valid: {', '.join(reducers)}")
    if cfg.optimizer is not None and cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    if not isinstance(cfg.workers, int) or cfg.workers < 1:
        raise ValueError(f"--workers must be a positive integer, got {cfg.workers!r}")
    if not (0 < float(cfg.density) <= 1):
        raise ValueError(f"--density must be in (0, 1], got {cfg.density}")
    if cfg.is_torch_ddp and cfg.network == "thread":
        raise ValueError("torch DDP baselines need real processes; use --loopback or --bandwidth")
    if cfg.convergence:
        from ..convergence import policy_from_options

        if cfg.is_torch_ddp or cfg.reducer == NOCOMM:
            raise ValueError(f"convergence options ({', '.join(sorted(cfg.convergence))}) apply to SparseDDP "
                             f"reducers, not to {cfg.reducer!r}")
        pol = policy_from_options(cfg.convergence)
        if pol.momentum and cfg.optimizer == "adam":
            raise ValueError("momentum correction replaces SGD's momentum (the optimizer becomes plain SGD); "
                             f"it does not apply to --optimizer {cfg.optimizer}")
    wl = make_workload(cfg.workload, **cfg.workload_options)
    cfg.fill_defaults(wl)
    local.check(cfg)  # (after the workload's defaults: DiLoCo's outer defaults follow the optimizer)
    _validate_optimizer(cfg)
    if cfg.convergence and cfg.convergence.get("momentum") and cfg.optimizer == "adamw":
        from ..convergence import policy_from_options
        from .optim import check_velocity_adamw

        check_velocity_adamw(cfg, policy_from_options(policy_options(cfg)))
    if cfg.rate_schedule:
        _check_rate_schedule(cfg)
    if cfg.convergence:  # what the run will use, as its label and config.json say
        cfg.convergence = policy_options(cfg)
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {cfg.steps}")
    if not isinstance(cfg.batch_size, int) or cfg.batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {cfg.batch_size!r}")
    if not isinstance(cfg.keep_checkpoints, int) or cfg.keep_checkpoints < 0:
        raise ValueError(f"--keep-checkpoints must be >= 0 (0 keeps all), got {cfg.keep_checkpoints!r}")
    return wl


def _validate_optimizer(cfg: TrainConfig) -> None:
    """The optimizer's numbers after defaults (sparsync.train.optim), one line each."""
    if cfg.lr_schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {cfg.lr_schedule!r}; valid: {', '.join(SCHEDULES)}")
    if not (isinstance(cfg.weight_decay, (int, float)) and 0 <= cfg.weight_decay < float("inf")):
        raise ValueError(f"--weight-decay must be a non-negative number, got {cfg.weight_decay!r}")
    for k in ("lr_warmup", "adam_freeze"):
        v = getattr(cfg, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"--{k.replace('_', '-')} must be a non-negative integer, got {v!r}")
    if cfg.adam_freeze and cfg.optimizer != "adamw":
        raise ValueError(f"--adam-freeze applies to --optimizer adamw, not {cfg.optimizer!r}")


def _check_rate_schedule(cfg: TrainConfig) -> None:
    from ..cluster import parse_rate_schedule

    sched = parse_rate_schedule(cfg.rate_schedule)
    if cfg.network in ("loopback", "thread", "torchrun", "none"):
        raise ValueError(f"--rate-schedule changes the emulated network's rates; the network here is {cfg.network!r} "
                         "(use --bandwidth RATE or --topology SxR --intra RATE --inter RATE)")
    late = [k for k in sched if k >= cfg.steps]
    if late:
        raise ValueError(f"--rate-schedule: step {min(late)} is not before the run's last step ({cfg.steps} steps)")


def check_network(network: str) -> None:
    """Raise NetworkUnavailable with instructions when the emulated network cannot run here."""
    if network in ("loopback", "thread"):
        return
    if os.geteuid() != 0:
        raise NetworkUnavailable(
            f"--bandwidth {network} emulates the network with Linux network namespaces and tc, which needs "
            "root. Run it as root (e.g. `sudo .venv/bin/sparsync train ... --bandwidth "
            f"{network}`), or use --loopback to run the workers over this machine's loopback "
            "interface (fast, so sparse methods show little gain), or torchrun on a real cluster "
            "(see docs/train.md).")
    try:
        from .. import cluster  # noqa: F401
    except ImportError as e:
        raise NetworkUnavailable(f"--bandwidth needs sparsync.cluster, which is not available ({e}); "
                                 "use --loopback") from None


def policy_options(cfg: TrainConfig) -> dict:
    """The run's GradientPolicy options: momentum correction takes the optimizer's kind of momentum,
    so with ``--optimizer nesterov`` it is Nesterov's unless ``nesterov`` is given explicitly; under
    ``--optimizer adamw`` masking is off unless given."""
    opts = dict(cfg.convergence)
    if opts.get("momentum") and cfg.optimizer == "nesterov":
        opts.setdefault("nesterov", True)
    if opts.get("momentum") and cfg.optimizer == "adamw":  # the optimizer is fed the whole velocity
        opts.setdefault("masking", False)                # (sparsync.velocity_adam)
    return opts

