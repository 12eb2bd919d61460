"""``sparsync bench reducers``: every reducer (and the baselines) timed on the same gradients, per network and P.

The gradients (:func:`bench_grads`) are the same for every reducer of a run; each (network, P) runs
its reducers in one process group, baselines first (:data:`REDUCER_BASELINES`); a fixed-threshold
reducer gets a threshold tuned to the target density (:func:`tuned_threshold`). The per-step timing
and its summary (a barrier before each step, the max over ranks, the median over steps) are
:mod:`sparsync.bench.timing`'s, re-exported here.
"""

from __future__ import annotations

import sys

import torch

from ..sparse import SparseVec
from .patterns import GRAD_PATTERNS, heavy_tail_grads
from .timing import (BASELINES, MAX_KEYS, PLAIN, TIME_KEYS, collective_fn, digest, make_grad, plain_allgather,
                     summarize, time_collective, time_reducer, timed_steps)

__all__ = [
    "BASELINES",
    "REDUCER_BASELINES",
    "RESIDUAL_MODES",
    "bench_grads",
    "collective_fn",
    "digest",
    "expand_reducers",
    "make_grad",
    "plain_allgather",
    "run_reducer_bench",
    "summarize",
    "time_collective",
    "time_reducer",
    # re-exported from .timing
    "MAX_KEYS", "PLAIN", "TIME_KEYS", "timed_steps",
]

_timed_steps = timed_steps  # its name before the timing moved to .timing


def bench_grads(pattern: str, rank: int, numel: int, seed: int, steps: int, device="cpu") -> list[torch.Tensor]:
    """The gradients one rank cycles through: ``"normal"`` (3 seeded normal vectors, or fewer when
    fewer steps run) or ``"heavy_tail"`` (two alternated heavy-tailed gradients; see
    :mod:`sparsync.bench.patterns`)."""
    if pattern == "normal":
        return [make_grad(rank, s, numel, seed, device=device) for s in range(min(steps, 3))]
    if pattern == "heavy_tail":
        return [g.to(device) for g in heavy_tail_grads(rank, numel)]
    raise ValueError(f"unknown gradient pattern {pattern!r}; choose one of {', '.join(GRAD_PATTERNS)}")


#: baseline rows of :func:`run_reducer_bench` -> the :func:`collective_fn` baseline they time
REDUCER_BASELINES = {"allreduce": "dense", "plain_allgather": "plain_allgather"}


def _baseline_records(comm, baseline, grads, numel, density, steps, warmup):
    """Timed records of a baseline row: ``"allreduce"`` (the bare in-place gloo all-reduce of a dense
    vector of ``numel``) or ``"plain_allgather"`` (the hand-written reference a user writes, on the exact
    top-k of each of this rank's gradients, indices precomputed, inputs used in turn)."""
    from ..select.topk import k_for_density, topk_abs

    algo = REDUCER_BASELINES[baseline]
    if algo == "dense":
        svs = None
    else:
        k = k_for_density(numel, density)
        svs = [SparseVec(*topk_abs(g, k), numel, check=False) for g in grads]
    recs = time_collective(comm, algo, svs, steps=steps, warmup=warmup, numel=numel)
    nnz = numel if svs is None else svs[0].nnz
    for r in recs:
        r.update(select_s=0.0, comm_s=r["total_s"], reducer=baseline, selected=nnz, density=nnz / numel)
    return recs


#: reducers with a FIXED threshold the user must tune per setting (the MiCRO paper, Yoon & Oh 2023,
#: on its hard-threshold baseline: "requires hyperparameter tuning for each model and dataset"):
#: :func:`_reducer_options` sets it from the workload unless the options give ``threshold``
FIXED_THRESHOLD = ("hard_threshold",)


def tuned_threshold(comm, g: torch.Tensor, density: float) -> float:
    """The fixed threshold that selects ``density`` of ``g``: its exact ``k``-th largest ``|g|``
    (``k = density * n``), averaged over ranks (one small all-reduce, outside any timing) so every
    rank uses the same value - how a user tunes a hard threshold to a target density once."""
    from ..select.topk import k_for_density, topk_abs

    _, vals = topk_abs(g, k_for_density(g.numel(), density))
    kth = vals.abs().min().reshape(1).double()
    with comm.unrecorded():
        return float(comm.allreduce(kth)[0]) / comm.world_size


def _reducer_options(comm, name: str, options: dict, grads, density: float) -> dict:
    """``options`` for reducer ``name``; a fixed-threshold reducer (:data:`FIXED_THRESHOLD`) without a
    ``threshold`` gets :func:`tuned_threshold` of this rank's first gradient, ``threshold="default"``
    keeps its own default (``1/(2 sqrt k)``, which knows nothing of the gradients' scale: on the
    heavy-tailed workload far more than the target passes it)."""
    opts = dict(options)
    if name in FIXED_THRESHOLD:
        if opts.get("threshold") == "default":
            del opts["threshold"]
        elif opts.get("threshold") is None:
            opts["threshold"] = tuned_threshold(comm, grads[0], density)
    return opts


def _reducers_worker(comm, reducers, numel, density, steps, warmup, seed, options, label, progress,
                     pattern="normal", residuals=("keep",), baselines=()):
    out = {}
    grads = bench_grads(pattern, comm.rank, numel, seed, steps + warmup, comm.device)
    for mode in residuals:
        for name in list(baselines) + list(reducers):
            if name in REDUCER_BASELINES:
                out[name, mode] = _baseline_records(comm, name, grads, numel, density, steps, warmup)
            else:
                opts = _reducer_options(comm, name, options.get(name, {}), grads, density)
                out[name, mode] = time_reducer(comm, name, numel, density, steps=steps, warmup=warmup, seed=seed,
                                               grads=grads, reset_residual=mode == "reset", **opts)
            if progress and comm.rank == 0:
                t = sorted(r["total_s"] for r in out[name, mode])
                print(f"  [{label} P={comm.world_size}] n={numel:.3g} density={density:g} {name} "
                      f"(residual {mode}): {t[len(t) // 2] * 1e3:.1f} ms (rank 0)", file=sys.stderr, flush=True)
    return out


def expand_reducers(names) -> list[str]:
    """``"all"`` -> every registered reducer (dense first); else validated names."""
    from ..reducers.registry import load_all

    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    registered = sorted(load_all(), key=lambda n: (n != "dense", n))
    out = []
    for n in names:
        if n == "all":
            out += registered
        elif n in registered:
            out.append(n)
        else:
            raise ValueError(f"unknown reducer {n!r}; valid: all, {', '.join(registered)}")
    return list(dict.fromkeys(out))


RESIDUAL_MODES = ("keep", "reset")


def run_reducer_bench(reducers, world_sizes, numel, density, networks=("loopback",), steps=5, warmup=2,
                      seed=0, options=None, timeout=600.0, fallback_loopback=False, progress=True,
                      pattern="normal", residuals=("keep",), baselines=()) -> list[dict]:
    """One row per (network, P, residual mode, reducer): medians of select/comm/total (max over
    ranks), bytes, achieved density and ``speedup`` (reference total / total; the reference is the
    ``allreduce`` baseline row when requested, else the ``dense`` reducer).
    ``baselines``: rows timed in the same process group before the reducers
    (:data:`REDUCER_BASELINES`: ``allreduce`` = the bare gloo all-reduce, ``plain_allgather`` = the
    plain all-gather reference on the exact top-k of the same gradients). Gradients
    (:func:`bench_grads`): ``pattern="normal"`` synthetic normal vectors (3 per rank, cycled: selection
    sees realistic magnitudes but not a real model's) or ``"heavy_tail"`` (:mod:`sparsync.bench.patterns`).
    ``residuals``: ``"keep"`` (error feedback carried between calls, the steady state) and/or
    ``"reset"`` (residual zeroed before every call). ``options``: reducer name -> its options; a
    fixed-threshold reducer (``hard_threshold``) gets a threshold tuned to the target density on the
    first gradient unless its options give one (:func:`_reducer_options`)."""
    if pattern not in GRAD_PATTERNS:
        raise ValueError(f"unknown gradient pattern {pattern!r}; choose one of {', '.join(GRAD_PATTERNS)}")
    bad = [m for m in residuals if m not in RESIDUAL_MODES]
    if bad or not residuals:
        raise ValueError(f"residual modes must be among {', '.join(RESIDUAL_MODES)}, got {list(residuals)}")
    from ..cluster import network_label, open_network
    from ..launch import run_local

    reducers = expand_reducers(reducers)
    bad = [b for b in baselines if b not in REDUCER_BASELINES]
    if bad:
        raise ValueError(f"unknown baselines {', '.join(bad)}; valid: {', '.join(REDUCER_BASELINES)}")
    rows = []
    for network in networks:
        for P in world_sizes:
            if progress:
                print(f"[{network}] {P} ranks: {len(reducers)} reducers, {steps} steps ...", file=sys.stderr,
                      flush=True)
            with open_network(network, P, fallback_loopback) as net:
                label = network_label(network, net)
                per_rank = run_local(_reducers_worker, P, reducers, int(numel), float(density), steps, warmup,
                                     seed, options or {}, label, progress, pattern, tuple(residuals),
                                     tuple(baselines), backend="gloo", timeout=timeout, placement=net.placement)
            for mode in residuals:
                group = []
                for name in list(baselines) + reducers:
                    s = summarize([r[name, mode] for r in per_rank])
                    row = {"network": label, "world_size": P, "numel": int(numel), "pattern": pattern,
                           "residual": mode, "target_density": float(density), "reducer": name}
                    row.update({k: v for k, v in s.items() if k not in ("world_size",)})
                    group.append(row)
                ref = "allreduce" if "allreduce" in baselines else "dense"
                dense = next((r["total_s"] for r in group if r["reducer"] == ref), None)
                for r in group:
                    r["speedup"] = dense / r["total_s"] if dense and r.get("total_s") else None
                rows += group
    return rows
