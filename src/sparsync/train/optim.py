"""The trainer's optimizers and learning-rate schedule.

``--optimizer``: ``sgd``, ``momentum`` / ``nesterov`` (SGD with momentum ``cfg.momentum``), ``adam``
and ``adamw`` (decoupled weight decay, Loshchilov & Hutter 2019; the optimizer of transformer
training). ``--weight-decay`` applies to matrices and embeddings only (parameters with two or more
dimensions; biases and LayerNorm gains are not decayed, as in GPT-2 / nanoGPT practice); for
``sgd`` / ``momentum`` / ``nesterov`` / ``adam`` it is torch's L2 ``weight_decay`` on the same set.

Schedule (:func:`lr_factor`; the learning rate of step ``t`` is ``lr * lr_factor(t)``): linear
warm-up ``(t + 1) / W`` over the first ``W = lr_warmup`` steps (Goyal et al. 2017), then
``constant`` (1) or ``cosine`` decay (Loshchilov & Hutter 2017, SGDR without restarts) from 1 at
step ``W`` to :data:`COSINE_FLOOR` at the last step. The factor is a function of the step number
alone (not of optimizer state), so a resumed run gets the same learning rates as an uninterrupted
one; it depends on the run's total ``steps``.

``adam_freeze``: AdamW whose second moment stops updating after that many steps
(:class:`sparsync.adam.FrozenVarianceAdamW`, as 1-bit Adam does after its warm-up; 0 = off).
With momentum correction (``momentum=b1,masking=false``) and ``adam_freeze`` the reducer averages the
ranks' velocities and AdamW is fed that momentum (:class:`sparsync.velocity_adam.VelocityAdamW`:
1-bit Adam's error-compensated momentum; :func:`check_velocity_adamw` says what it needs).
"""

from __future__ import annotations

import math

import torch

__all__ = ["COSINE_FLOOR", "OPTIMIZERS", "SCHEDULES", "check_velocity_adamw", "lr_factor", "make_optimizer",
           "set_lr"]

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
SCHEDULES = ("constant", "cosine")
#: the cosine schedule ends at this fraction of the peak learning rate (nanoGPT's min_lr = lr / 10)
COSINE_FLOOR = 0.1


def lr_factor(step: int, steps: int, warmup: int = 0, schedule: str = "constant") -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based) of a ``steps``-step run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, steps - 1 - warmup)
    frac = min(1.0, (step - warmup) / span)
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * frac))


def set_lr(opt: torch.optim.Optimizer, cfg, step: int) -> None:
    """Set every parameter group's learning rate to the schedule's value for ``step``."""
    lr = cfg.lr * lr_factor(step, cfg.steps, cfg.lr_warmup or 0, cfg.lr_schedule or "constant")
    for g in opt.param_groups:
        g["lr"] = lr


def _groups(params, weight_decay: float) -> list[dict]:
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` asks for, over ``params``. With momentum correction
    (``cfg.convergence["momentum"]``, :mod:`sparsync.convergence`) SGD's momentum lives in the
    GradientPolicy, so the optimizer is plain SGD."""
    params = list(params)
    wd = float(cfg.weight_decay or 0.0)
    groups = _groups(params, wd)
    momentum = float(cfg.convergence.get("momentum") or 0.0)
    if momentum and cfg.optimizer == "adamw":
        from ..velocity_adam import VelocityAdamW

        return VelocityAdamW(groups, lr=cfg.lr, betas=(momentum, 0.999), freeze_after=int(cfg.adam_freeze))
    if cfg.optimizer == "sgd" or momentum:
        return torch.optim.SGD(groups, lr=cfg.lr)
    if cfg.optimizer in ("momentum", "nesterov"):
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.optimizer == "nesterov")
    if cfg.optimizer == "adamw":
        freeze = int(getattr(cfg, "adam_freeze", 0) or 0)
        if freeze:
            from ..adam import FrozenVarianceAdamW

            return FrozenVarianceAdamW(groups, lr=cfg.lr, freeze_after=freeze)
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.Adam(groups, lr=cfg.lr)


def check_velocity_adamw(cfg, policy) -> None:
    """Momentum correction under AdamW (:class:`sparsync.velocity_adam.VelocityAdamW`) needs: the second
    moment frozen (``adam_freeze`` >= 1), a lossless exchange until then (``dense_steps >= adam_freeze``:
    the warm-up recovers the averaged gradient from consecutive velocities), the whole velocity kept
    (``masking=false``) and plain (not Nesterov) momentum. One-line ``ValueError`` otherwise."""
    need = []
    if not cfg.adam_freeze:
        need.append("adam_freeze=N (the second moment frozen after N steps)")
    elif policy.dense_steps < cfg.adam_freeze:
        need.append(f"dense_steps >= adam_freeze ({policy.dense_steps} < {cfg.adam_freeze})")
    if policy.masking:
        need.append("masking=false")
    if policy.nesterov:
        need.append("nesterov=false")
    if need:
        raise ValueError("momentum correction under --optimizer adamw (error feedback on the momentum, 1-bit Adam) "
                         "needs " + ", ".join(need))
