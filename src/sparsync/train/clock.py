"""What a row's clock and its evaluations see: the slowest rank's time, the model a user would keep, and
the link ratio the row ran at.

* **The clock** of a run is the slowest rank's training time. Every rank sums its own step times; at
  every evaluation the ranks meet (they would wait for the slowest one at their next collective anyway)
  and every rank's clock becomes the largest (:func:`slowest`), so a row whose ranks lag each other
  (local steps: up to H steps of compute between two meetings) is not timed by its fastest rank.
  Evaluation itself is not timed.
* **The evaluated model** is the one a user would keep at that step (:func:`kept_model`): with local
  steps (DiLoCo, torch's post-local SGD) each rank holds its own model between synchronisations, and
  the model to keep is their average - one untimed, unrecorded all-reduce of the parameters per
  evaluation (none right after a DiLoCo synchronisation, when every rank holds the same parameters).
  Every other row's ranks hold the same model. Rank 0 alone evaluates it, and every rank receives its
  numbers (:func:`evaluate_once`): the same evaluations everywhere, and that exchange is the ranks'
  meeting before the next step.
* **The link ratio** ``r = T_allreduce / T_compute`` (Douillard et al., "DiLoCo", 2023, and
  Sarfi et al., "SparseLoCo", 2025, choose local steps where communication dominates compute):
  ``T_allreduce`` is a dense fp32 all-reduce of the model's parameters on this run's group, timed at
  the start (:func:`time_allreduce`, the least of two calls, untimed and unrecorded), ``T_compute``
  the row's compute per step. Compute utilisation is ``T_compute`` over the mean step time.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

__all__ = ["evaluate_once", "kept_model", "slowest", "time_allreduce", "link_ratio", "utilisation"]

#: what an evaluation returns, in the order it travels (a workload gives a subset; a missing one travels as NaN)
EVAL_KEYS = ("accuracy", "loss", "perplexity")


def time_allreduce(comm, numel: int, calls: int = 2) -> float | None:
    """Seconds of one dense fp32 all-reduce of ``numel`` values on ``comm`` (the least of ``calls``),
    not counted in the ledger; None for a single rank."""
    if comm.world_size == 1:
        return None
    buf = torch.zeros(numel, dtype=torch.float32, device=comm.device)
    best = float("inf")
    with comm.unrecorded():
        comm.barrier()
        for _ in range(calls):
            t0 = time.perf_counter()
            comm.allreduce(buf)
            best = min(best, time.perf_counter() - t0)
    # every rank takes the slowest rank's reading (the same number everywhere)
    got = comm.allgather_control(torch.tensor([best], dtype=torch.float64, device=comm.device))
    return max(float(t.reshape(-1)[0]) for t in got)


def slowest(comm, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (one control all-gather: a meeting of all ranks)."""
    if comm.world_size == 1:
        return seconds
    got = comm.allgather_control(torch.tensor([seconds], dtype=torch.float64, device=comm.device))
    return max(float(t.reshape(-1)[0]) for t in got)


def kept_model(model: nn.Module, comm, local_steps: bool, in_sync: bool) -> nn.Module:
    """The model to evaluate: ``model`` itself, or with local steps (and ranks not ``in_sync``) a copy
    holding the average of every rank's parameters (module docstring)."""
    if not local_steps or in_sync or comm.world_size == 1:
        return model
    avg = copy.deepcopy(model)
    with torch.no_grad(), comm.unrecorded():
        for p in avg.parameters():
            total = comm.allreduce(p.detach().reshape(-1).to(torch.float32).clone())
            p.copy_(total.div_(comm.world_size).view_as(p).to(p.dtype))
    return avg


def link_ratio(allreduce_s: float | None, compute_s: float | None) -> float | None:
    """``r = T_allreduce / T_compute`` (None when either is unknown)."""
    if not allreduce_s or not compute_s:
        return None
    return allreduce_s / compute_s


def utilisation(compute_s: float | None, step_s: float | None) -> float | None:
    """Compute per step over the mean step time (None when either is unknown), at most 1."""
    if not compute_s or not step_s:
        return None
    return min(1.0, compute_s / step_s)


def evaluate_once(workload, model: nn.Module, comm) -> dict:
    """``workload.evaluate(model)`` on rank 0 only, every rank returning rank 0's numbers (one control
    all-gather, also the meeting of all ranks after it): the other ranks' cores stay free for it instead
    of each rank evaluating the same model. (Not with more intra-op threads: a rank forked from a
    parent that ran OpenMP work can hang when it starts an OpenMP pool of its own.)"""
    vals = torch.full((len(EVAL_KEYS),), float("nan"), dtype=torch.float64, device=comm.device)
    if comm.rank == 0:
        ev = workload.evaluate(model)
        extra = set(ev) - set(EVAL_KEYS)
        if extra:
            raise ValueError(f"evaluate_once: {workload.name}.evaluate returned {sorted(extra)}, not in EVAL_KEYS")
        vals = torch.tensor([float(ev.get(k, float("nan"))) for k in EVAL_KEYS], dtype=torch.float64,
                            device=comm.device)
    if comm.world_size > 1:
        vals = comm.allgather_control(vals)[0]
    return {k: float(v) for k, v in zip(EVAL_KEYS, vals.reshape(-1).tolist()) if v == v}
