"""Per-step timing of reducers and lossless collectives on one rank, and their summaries.

Why: every benchmark in this project compares methods the same way (``docs/benchmarks.md``):
each timed step starts with a barrier so the ranks begin together, the step's time is the MAX over
ranks (the slowest rank gates a synchronous data-parallel step) and a configuration's time is the
MEDIAN over steps (robust to the noise of a shared 2-core machine). Bytes come from the ledger
(``comm.py``), so they are the same on every backend.

* :func:`time_reducer` runs ``make_reducer(name, comm, density, **options)`` for ``warmup + steps``
  steps and returns one dict per timed step: the reducer's ``stats`` after the step (``select_s``,
  ``comm_s``, ``total_s``, ``selected``, ``density``, ``bytes_sent``, ...) plus ``wall_s`` (wall
  time of ``reduce`` measured here).
* :func:`time_collective` does the same for a lossless algorithm of ``sparsync.collectives`` on a
  fixed SparseVec, and for the dense baseline (``algorithm="dense"``: ``comm.allreduce`` of a dense
  vector of the same numel, built before the clock starts - a dense trainer already has it).
* :func:`summarize` reduces ``[rank][step] -> dict`` results: per step max over ranks of the times
  (and bytes), then median over steps; achieved density is the mean over ranks (median over steps).
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from ..collectives import load_all as load_collectives
from ..reducers import make_reducer
from ..sparse import SparseVec

__all__ = [
    "collective_fn",
    "digest",
    "expand_reducers",
    "make_grad",
    "run_reducer_bench",
    "summarize",
    "time_collective",
    "time_reducer",
]

TIME_KEYS = ("select_s", "comm_s", "total_s", "wall_s")
MAX_KEYS = ("bytes_sent", "bytes_received", "messages", "rounds")


def make_grad(rank: int, step: int, numel: int, seed: int = 0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A synthetic dense gradient: standard normal, seeded by ``(seed, rank, step)``."""
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + int(rank)) * 10_007 + int(step) + 1)
    return torch.randn(int(numel), generator=g, dtype=dtype).to(device)


def digest(x) -> str:
    """Short hash of a payload's bytes (SparseVec or tensor): equal digests across ranks = bitwise equal."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(x, SparseVec):
        h.update(x.indices.cpu().numpy().tobytes())
        x = x.values
    h.update(x.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _grad_source(grads, comm, numel, seed) -> Callable[[int], torch.Tensor]:
    if grads is None:
        return lambda step: make_grad(comm.rank, step, numel, seed, device=comm.device)
    if callable(grads):
        return grads
    if isinstance(grads, torch.Tensor):
        return lambda step: grads
    grads = list(grads)
    if not grads:
        raise ValueError("grads is an empty sequence")
    return lambda step: grads[step % len(grads)]


def time_reducer(comm, name: str, numel: int, density: float = 0.01, steps: int = 5, warmup: int = 2,
                 seed: int = 0, grads=None, **options) -> list[dict]:
    """Per-step stats of reducer ``name`` on this rank (``steps`` timed steps after ``warmup``).

    ``grads``: None (synthetic normal gradients seeded by ``(seed, rank, step)``), a tensor (reused
    every step), a sequence (cycled) or a callable ``step -> tensor``. Gradients are produced
    before the clock starts.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    reducer = make_reducer(name, comm, density=density, **options)
    source = _grad_source(grads, comm, int(numel), seed)
    out: list[dict] = []
    for step in range(warmup + steps):
        g = source(step)
        comm.barrier()
        t0 = time.perf_counter()
        reducer.reduce(g)
        wall = time.perf_counter() - t0
        if step >= warmup:
            rec = dict(reducer.stats)
            rec.update(step=step - warmup, wall_s=wall, reducer=name)
            out.append(rec)
    return out


def collective_fn(comm, algorithm: str, sv: SparseVec | None, numel: int | None = None,
                  **options) -> Callable[[], object]:
    """A no-argument callable running one lossless all-reduce of ``sv`` (or the dense baseline).

    Registered algorithms are called directly (no input check, no conversion of a dense result to
    a SparseVec), so timing covers the algorithm only. ``"dense"``: ``comm.allreduce`` of
    ``sv.to_dense()`` (or of a random vector of ``numel`` elements when ``sv`` is None), built now.
    """
    if algorithm == "dense":
        if options:
            raise TypeError(f"the dense baseline takes no options, got {', '.join(sorted(options))}")
        dense = sv.to_dense() if sv is not None else torch.randn(int(numel), device=comm.device)
        return lambda: comm.allreduce(dense)
    algos = load_collectives()
    if algorithm not in algos:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: dense, {', '.join(sorted(algos))}")
    fn = algos[algorithm]
    return lambda: fn(sv, comm, **options)


def time_collective(comm, algorithm: str, sv: SparseVec | None, steps: int = 5, warmup: int = 2,
                    numel: int | None = None, check: bool = False, **options) -> list[dict]:
    """Per-step wall time and ledger cost of a lossless all-reduce on this rank.

    ``algorithm`` is a name registered in :mod:`sparsync.collectives` (called directly under its
    ledger phase, no input check, so only the algorithm is timed) or ``"dense"`` (``comm.allreduce``
    of a dense vector of ``sv.numel`` - or ``numel`` - elements). With ``check=True`` the last
    step's record carries ``digest`` (hash of the output bytes) and ``out_nnz``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    call = collective_fn(comm, algorithm, sv, numel=numel, **options)
    records: list[dict] = []
    result = None
    for step in range(warmup + steps):
        comm.barrier()
        snap = comm.ledger.snapshot()
        t0 = time.perf_counter()
        with comm.phase(algorithm):
            result = call()
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        wall = time.perf_counter() - t0
        if step >= warmup:
            cost = comm.ledger.since(snap)
            records.append({"step": step - warmup, "algorithm": algorithm, "total_s": wall, "wall_s": wall,
                                "bytes_sent": cost["bytes_sent"], "bytes_received": cost["bytes_received"],
                                "messages": cost["messages_sent"], "rounds": cost["rounds"]})
    if check and records:
        records[-1]["digest"] = digest(result)
        records[-1]["out_nnz"] = int(result.nnz if isinstance(result, SparseVec)
                                     else torch.count_nonzero(result))
    return records


def summarize(per_rank_results: Sequence[Sequence[dict]]) -> dict:
    """``[rank][step] -> dict`` to one dict: per step max over ranks, then median over steps.

    Times (``select_s``, ``comm_s``, ``total_s``, ``wall_s``) and volumes (``bytes_sent``,
    ``bytes_received``, ``messages``, ``rounds``) present in the records are summarised that way;
    ``density`` / ``selected`` (achieved) are the mean over ranks, median over steps. Also returns
    ``steps``, ``world_size`` and ``total_s_all`` (the per-step maxima, for spread).
    """
    if not per_rank_results or not all(per_rank_results):
        raise ValueError("summarize needs at least one step from every rank")
    nsteps = min(len(r) for r in per_rank_results)
    out: dict = {"world_size": len(per_rank_results), "steps": nsteps}
    first = per_rank_results[0][0]
    for key in TIME_KEYS + MAX_KEYS:
        if key in first:
            per_step = [max(float(r[s].get(key, 0.0)) for r in per_rank_results) for s in range(nsteps)]
            out[key] = statistics.median(per_step)
            if key == "total_s":
                out["total_s_all"] = per_step
    for key in ("density", "selected"):
        if key in first:
            per_step = [statistics.fmean(float(r[s][key]) for r in per_rank_results) for s in range(nsteps)]
            out[key] = statistics.median(per_step)
    return out


# ---------------------------------------------------------------------- driver (``sparsync bench reducers``)
def _reducers_worker(comm, reducers, numel, density, steps, warmup, seed, options, label, progress):
    out = {}
    grads = [make_grad(comm.rank, s, numel, seed, device=comm.device) for s in range(min(steps + warmup, 3))]
    for name in reducers:
        out[name] = time_reducer(comm, name, numel, density, steps=steps, warmup=warmup, seed=seed,
                                 grads=grads, **options.get(name, {}))
        if progress and comm.rank == 0:
            t = sorted(r["total_s"] for r in out[name])
            print(f"  [{label} P={comm.world_size}] n={numel:.3g} density={density:g} {name}: "
                  f"{t[len(t) // 2] * 1e3:.1f} ms (rank 0)", file=sys.stderr, flush=True)
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


def run_reducer_bench(reducers, world_sizes, numel, density, networks=("loopback",), steps=5, warmup=2,
                      seed=0, options=None, timeout=600.0, fallback_loopback=False, progress=True) -> list[dict]:
    """One row per (network, P, reducer): medians of select/comm/total (max over ranks), bytes,
    achieved density and ``speedup`` (dense total / total). Gradients are synthetic normal vectors
    (3 per rank, cycled), so selection sees realistic magnitudes but not a real model's."""
    from ..launch import run_local
    from .allreduce import network_context

    reducers = expand_reducers(reducers)
    rows = []
    for network in networks:
        for P in world_sizes:
            if progress:
                print(f"[{network}] {P} ranks: {len(reducers)} reducers, {steps} steps ...", file=sys.stderr,
                      flush=True)
            with network_context(network, P, fallback_loopback) as net:
                label = network if (network == "loopback" or net.emulated) else f"{network}->loopback"
                per_rank = run_local(_reducers_worker, P, reducers, int(numel), float(density), steps, warmup,
                                     seed, options or {}, label, progress, backend="gloo", timeout=timeout,
                                     placement=net.placement)
            group = []
            for name in reducers:
                s = summarize([r[name] for r in per_rank])
                row = {"network": label, "world_size": P, "numel": int(numel), "target_density": float(density),
                           "reducer": name}
                row.update({k: v for k, v in s.items() if k not in ("world_size",)})
                group.append(row)
            dense = next((r["total_s"] for r in group if r["reducer"] == "dense"), None)
            for r in group:
                r["speedup"] = dense / r["total_s"] if dense and r.get("total_s") else None
            rows += group
    return rows
