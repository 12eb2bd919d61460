"""``sparsync bench allreduce``: dense all-reduce vs the lossless sparse all-reduce algorithms.

Why: the first question for every sparse method is whether it beats a plain dense all-reduce at
a given size, density, world size and link speed (``docs/benchmarks.md``). All algorithms of one
configuration run side by side in ONE process group (one :func:`~sparsync.launch.run_local` per
world size and network), interleaved round-robin step by step so that noise on the shared machine
hits them alike.

Method (same as :mod:`sparsync.bench.reducers`): inputs come from
:func:`sparsync.bench.patterns.make_sparse`; every timed call starts after a barrier; a step's time
is the max over ranks; the reported time is the median over ``repeats`` steps; bytes/rounds come
from the ledger. The warm-up calls also check correctness: the output must equal the exact sum of
all ranks' inputs (computed on rank 0 in float64, tolerance ``1e-5 * (1 + |x|)``) and be bitwise
identical on every rank (hash of the output bytes).

Networks: ``"loopback"`` (gloo over ``lo``), or a bandwidth such as ``"1gbit"`` / ``"none"``
(an :class:`~sparsync.cluster.EmulatedCluster` with that per-link rate).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from ..collectives.auto import AutoState
from ..sparse import SparseVec
from .patterns import ALTERNATING, make_sparse
from .reducers import BASELINES, collective_fn, digest, summarize

__all__ = ["allreduce_worker", "expand_algorithms", "run_allreduce_bench"]


def expand_algorithms(names: Sequence[str] | str) -> list[str]:
    """``"all"`` -> the baselines (dense, plain_allgather) + every registered lossless algorithm
    (discovered now); else validated names."""
    from ..collectives import load_all

    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    registered = sorted(load_all())
    out: list[str] = []
    for n in names:
        if n == "all":
            out += list(BASELINES) + registered
        elif n in BASELINES or n in registered:
            out.append(n)
        else:
            raise ValueError(f"unknown algorithm {n!r}; valid: all, {', '.join(BASELINES)}, "
                             f"{', '.join(registered)}")
    return list(dict.fromkeys(out))  # dedupe, keep order


def _reference(pattern, P, numel, density, seed):
    ref = torch.zeros(numel, dtype=torch.float64)
    for r in range(P):
        sv = make_sparse(pattern, r, P, numel, density, seed)  # variant 0: the one the check runs
        ref.index_add_(0, sv.indices, sv.values.double())
    return ref


def _as_dense(x):
    return x.to_dense() if isinstance(x, SparseVec) else x


def allreduce_worker(comm, configs, algorithms, repeats=5, warmup=1, seed=0, check=True, label="",
                     progress=True, dense=False, auto_state=None) -> list[dict]:
    """Run every ``(numel, density, pattern)`` in ``configs`` for every algorithm on this rank.

    Returns one record per (config, algorithm, timed step) plus one ``kind="check"`` record per
    (config, algorithm) with the output digest and (rank 0) the max error against the reference.
    Exceptions inside an algorithm are recorded (``error``) and the algorithm is dropped for that
    configuration; a failure that leaves ranks out of step ends the run at the gloo timeout.
    Alternating patterns (``heavy_tail``) build both inputs before the clock starts and use input
    ``step % 2`` at timed step ``step`` (the check runs on input 0). ``dense=True``: every algorithm's
    result is made dense inside the timed call (:func:`~sparsync.bench.reducers.collective_fn`).
    ``auto`` keeps its calibration and measured choices in ``auto_state`` (an
    :class:`~sparsync.collectives.auto.AutoState`; default: a fresh one for this call's configs).
    """
    P, rank = comm.world_size, comm.rank
    auto_opts = {"state": auto_state if auto_state is not None else AutoState()}
    records: list[dict] = []
    for numel, density, pattern in configs:
        numel = int(numel)
        key = {"numel": numel, "density": density, "pattern": pattern}
        try:
            svs = [make_sparse(pattern, rank, P, numel, density, seed, variant=j)
                   for j in range(2 if pattern in ALTERNATING else 1)]
        except ValueError as e:  # deterministic: the same on every rank
            records += [dict(key, algorithm=a, kind="error", error=str(e)) for a in algorithms]
            continue
        ref = _reference(pattern, P, numel, density, seed) if check and rank == 0 else None
        calls, live = {}, []
        for a in algorithms:
            try:
                calls[a] = [collective_fn(comm, a, sv, dense=dense, **(auto_opts if a == "auto" else {}))
                            for sv in svs]
                live.append(a)
            except Exception as e:  # noqa: BLE001
                records.append(dict(key, algorithm=a, kind="error", error=f"{type(e).__name__}: {e}"))
        for w in range(max(warmup, 1 if check else 0)):
            for a in list(live):
                comm.barrier()
                try:
                    with comm.phase(a):
                        out = calls[a][0]()
                except Exception as e:  # noqa: BLE001
                    live.remove(a)
                    records.append(dict(key, algorithm=a, kind="error", error=f"{type(e).__name__}: {e}"))
                    continue
                if w == 0 and check:
                    rec = dict(key, algorithm=a, kind="check", digest=digest(out))
                    if ref is not None:
                        d = _as_dense(out).double()
                        rec["max_err"] = float(((d - ref).abs() / (1 + ref.abs())).max()) if numel else 0.0
                    records.append(rec)
                del out
        for step in range(repeats):
            for a in live:
                comm.barrier()
                snap = comm.ledger.snapshot()
                t0 = time.perf_counter()
                with comm.phase(a):
                    calls[a][step % len(svs)]()
                if comm.device.type == "cuda":
                    torch.cuda.synchronize(comm.device)
                wall = time.perf_counter() - t0
                cost = comm.ledger.since(snap)
                records.append(dict(key, algorithm=a, kind="step", step=step, total_s=wall,
                                    bytes_sent=cost["bytes_sent"], bytes_received=cost["bytes_received"],
                                    messages=cost["messages_sent"], rounds=cost["rounds"]))
        if progress and rank == 0:
            mine = {}
            for r in records:
                if r.get("kind") == "step" and r["numel"] == numel and r["density"] == density \
                        and r["pattern"] == pattern:
                    mine.setdefault(r["algorithm"], []).append(r["total_s"])
            summary = ", ".join(f"{a} {sorted(t)[len(t) // 2] * 1e3:.1f} ms" for a, t in mine.items())
            print(f"  [{label} P={P}] n={numel:.3g} density={density:g} {pattern}: {summary} (rank 0)",
                  file=sys.stderr, flush=True)
        del calls, svs, ref
    return records


def run_allreduce_bench(world_sizes, numels, densities, patterns, algorithms, networks=("loopback",),
                        repeats=5, warmup=1, seed=0, check=True, timeout=600.0, fallback_loopback=False,
                        progress=True, dense=False, reference="dense") -> list[dict]:
    """Run the benchmark grid; returns one summary row per (network, P, numel, density, pattern, algo).

    Row keys: ``network, world_size, numel, density, pattern, algorithm, time_s`` (median over steps
    of the max over ranks), ``speedup`` (reference time / time, same network/P/config), ``bytes_sent``,
    ``bytes_received``, ``rounds``, ``messages`` (max over ranks), ``correct`` (None if unchecked),
    ``max_err``, ``error``, ``times_s`` (per-step maxima); ``reference`` names the row ``speedup``
    divides by (default the dense all-reduce). ``dense=True``: results made dense in the
    timed call (the lossless algorithms through ``sparse_allreduce_dense``).
    """
    from ..cluster import network_label, open_network
    from ..launch import run_local

    algorithms = expand_algorithms(algorithms)
    configs = [(int(float(n)), float(d), p) for n in numels for d in densities for p in patterns]
    rows: list[dict] = []
    for network in networks:
        for P in world_sizes:
            t0 = time.perf_counter()
            if progress:
                print(f"[{network}] {P} ranks: {len(configs)} configs x {len(algorithms)} algorithms, "
                      f"{repeats} repeats ...", file=sys.stderr, flush=True)
            with open_network(network, P, fallback_loopback) as net:
                label = network_label(network, net)
                per_rank = run_local(allreduce_worker, P, configs, algorithms, repeats, warmup, seed, check,
                                     label, progress, dense, backend="gloo", timeout=timeout,
                                     placement=net.placement)
            if progress:
                print(f"[{network}] {P} ranks done in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                      flush=True)
            rows += _summarize_run(per_rank, configs, algorithms, label, P, reference)
    return rows


def _summarize_run(per_rank, configs, algorithms, network, P, reference="dense") -> list[dict]:
    rows = []
    for numel, density, pattern in configs:
        def mine(recs, a, kind, cfg=(numel, density, pattern)):
            return [r for r in recs if (r["numel"], r["density"], r["pattern"]) == cfg
                    and r["algorithm"] == a and r.get("kind") == kind]

        group = []
        for a in algorithms:
            row = {"network": network, "world_size": P, "numel": numel, "density": density, "pattern": pattern,
                   "algorithm": a}
            errors = [e["error"] for recs in per_rank for e in mine(recs, a, "error")]
            if errors:
                row["error"] = errors[0]
            steps = [mine(recs, a, "step") for recs in per_rank]
            if all(steps):
                s = summarize(steps)
                row.update(time_s=s["total_s"], times_s=s["total_s_all"], bytes_sent=s["bytes_sent"],
                           bytes_received=s["bytes_received"], rounds=s["rounds"], messages=s["messages"])
            checks = [mine(recs, a, "check") for recs in per_rank]
            if all(checks):
                digests = {c[0]["digest"] for c in checks}
                err = checks[0][0].get("max_err")
                row["max_err"] = err
                row["correct"] = len(digests) == 1 and err is not None and err <= 1e-5
            group.append(row)
        dense = next((r.get("time_s") for r in group if r["algorithm"] == reference), None)
        for r in group:
            if dense and r.get("time_s"):
                r["speedup"] = dense / r["time_s"]
        rows += group
    return rows
