"""torch's own post-local SGD, set up as a torch user writes it: the baseline row ``ddp-localsgd<H>``.

Post-local SGD (Lin et al. 2020, "Don't use large mini-batches, use local SGD"): synchronous
data-parallel SGD for ``warmup`` steps, then local steps with the parameters averaged over all
ranks every H steps. torch ships it as three pieces, used here unchanged::

    ddp = DistributedDataParallel(model, process_group=group)
    state = PostLocalSGDState(process_group=group, subgroup=subgroup, start_localSGD_iter=warmup)
    ddp.register_comm_hook(state, post_localSGD_hook)           # all-reduce of gradients until warm-up ends
    opt = PostLocalSGDOptimizer(optim=inner, averager=PeriodicModelAverager(period=H, warmup_steps=warmup,
                                                                           process_group=group))

After the warm-up the hook all-reduces gradients only inside ``subgroup`` (torch's default: the
ranks of one node, found with ``new_subgroups()``, which counts CUDA devices and so fails on CPU).
Here every rank is its own host (one rank per network namespace, or per machine), so the explicit
subgroup of each rank is itself: no traffic between ranks outside the averaging steps.
``warmup_steps`` and ``start_localSGD_iter`` must be equal (torch's docs).

:func:`bytes_per_rank` is the row's wire accounting per step (gloo ring all-reduce, fp32): the
gradient during the warm-up, the parameters at an averaging step, nothing otherwise.
"""

from __future__ import annotations

import re

__all__ = ["NAME_RE", "averages_at", "bytes_per_rank", "parse_period", "post_local_sgd"]

#: ``ddp-localsgd<H>``: torch's post-local SGD averaging every H steps
NAME_RE = re.compile(r"^ddp-localsgd(\d+)$")


def parse_period(name: str) -> int | None:
    """H of a ``ddp-localsgd<H>`` name (>= 2), None for any other name; ValueError for H < 2."""
    m = NAME_RE.match(name)
    if m is None:
        return None
    H = int(m.group(1))
    if H < 2:
        raise ValueError(f"{name!r}: the averaging period must be >= 2 (H = 1 is plain DDP: use 'ddp')")
    return H


def post_local_sgd(model, group, inner_optimizer, period: int, warmup: int):
    """``(ddp_model, optimizer)``: torch DDP with ``post_localSGD_hook`` and ``PostLocalSGDOptimizer``
    wrapping ``inner_optimizer`` with a ``PeriodicModelAverager(period, warmup)``. Collective: every
    rank of ``group`` (None: the default group) must call it."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    subgroup, _ = dist.new_subgroups_by_enumeration([[r] for r in ranks])  # one host per rank
    ddp = DDP(model, process_group=group)
    state = PostLocalSGDState(process_group=group, subgroup=subgroup, start_localSGD_iter=warmup)
    ddp.register_comm_hook(state, post_localSGD_hook)
    opt = PostLocalSGDOptimizer(optim=inner_optimizer,
                                averager=PeriodicModelAverager(period=period, warmup_steps=warmup, process_group=group))
    return ddp, opt


def averages_at(step: int, period: int, warmup: int) -> bool:
    """Whether ``PeriodicModelAverager`` averages after step ``step`` (0-based; torch's rule)."""
    return step >= warmup and (step - warmup) % period == 0


def bytes_per_rank(step: int, period: int, warmup: int, numel: int, workers: int) -> int:
    """Bytes one rank sends at ``step``: a ring all-reduce (``2(P-1)/P * numel * 4``) of the gradient
    in a warm-up step (the hook's global all-reduce) and of the parameters at an averaging step; zero
    otherwise (the hook's all-reduce inside the one-rank subgroup sends nothing)."""
    ring = 2 * (workers - 1) * numel * 4 // workers if workers > 1 else 0
    return ring * ((step < warmup) + averages_at(step, period, warmup))
