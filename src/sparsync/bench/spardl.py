"""SparDL benchmark and ledger table (``docs/benchmarks.md``, "SparDL and its baselines").

Two entry points (``python -m sparsync.bench.spardl ledger|cluster``):

* ``ledger``: thread backend, one step of every SparDL variant and sparse baseline per world size
  ``P = 4..16``; prints the measured rounds and received volume per rank (max over ranks, in 4-byte
  index/value units, i.e. bytes / 4) next to the paper's Table I formula (Zhao et al. 2023, §III-D).
* ``cluster``: gloo ranks on the emulated 1 Gbit/s cluster (:mod:`sparsync.cluster`), time per reduce
  split into selection and communication for dense, topka, topkdsa, gtopk (powers of two), oktopk,
  spardl d=1 and every admissible R-SAG / B-SAG ``d`` (the table keeps the best of each), using
  :func:`sparsync.bench.reducers.time_reducer` / :func:`~sparsync.bench.reducers.summarize` (barrier
  before each step, max over ranks, median over steps). One cluster per world size; all sizes and
  densities run inside it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

__all__ = ["cluster_configs", "cluster_markdown", "ledger_markdown", "ledger_rows", "main", "run_cluster"]


# ---------------------------------------------------------------------- ledger table
def _ledger_worker(comm, n, k, configs):
    import sparsync as ss

    out = {}
    for label, name, opts in configs:
        r = ss.make_reducer(name, comm, density=k / n, **opts)
        g = torch.Generator().manual_seed(comm.rank)
        comm.ledger.reset()
        r.reduce(torch.randn(n, generator=g))
        if name == "oktopk":  # the two data phases (threshold/balance phases are periodic extras)
            ph = [comm.ledger.phases[p] for p in ("oktopk:reduce-scatter", "oktopk:allgather")]
            out[label] = (sum(p.rounds for p in ph), sum(p.bytes_received for p in ph))
        else:
            out[label] = (r.stats["rounds"], r.stats["bytes_received"])
    return out


def _ledger_configs(P):
    cfg = [("SparDL d=1", "spardl", {}), ("TopkA", "topka", {}), ("TopkDSA", "topkdsa", {}),
           ("Ok-Topk", "oktopk", {})]
    if P & (P - 1) == 0:
        cfg.append(("gTopk", "gtopk", {}))
    if P % 2 == 0:
        cfg.append(("R-SAG d=2", "spardl", {"teams": 2}))
    odd = [d for d in range(3, P) if P % d == 0 and d & (d - 1)]
    if odd:
        cfg.append((f"B-SAG d={odd[-1]}", "spardl", {"teams": odd[-1], "team_allgather": "b"}))
    return cfg


def ledger_rows(world_sizes=range(4, 17), n=1_008_000, k=10_080):
    """Measured vs Table I per world size (thread backend, one step, random normal gradients)."""
    from ..launch import run_local
    from ..reducers.spardl import SparDLReducer

    rows = []
    for P in world_sizes:
        cfg = _ledger_configs(P)
        res = run_local(_ledger_worker, P, n, k, cfg)
        for label, _name, opts in cfg:
            rounds = max(r[label][0] for r in res)
            units = max(r[label][1] for r in res) / 4
            lg = math.ceil(math.log2(P))
            if label.startswith("SparDL"):
                f_units, f_rounds = 4 * k * (P - 1) / P, 2 * lg
            elif label.startswith(("R-SAG", "B-SAG")):
                d = opts["teams"]
                kind = "r" if label.startswith("R") else "b"
                f_units = SparDLReducer.table_cost(P, k, d, kind)
                f_rounds = 2 * math.ceil(math.log2(P // d)) + math.ceil(math.log2(d))
            elif label == "TopkA":
                f_units, f_rounds = 2 * (P - 1) * k, f"{lg} (rec. doubling)"
            elif label == "TopkDSA":
                f_units, f_rounds = (4 * (P - 1) / P * k, (P - 1) / P * (2 * k + n)), P + 2 * lg
            elif label == "gTopk":
                f_units, f_rounds = 4 * lg * k, 2 * lg
            else:
                f_units, f_rounds = (2 * (P - 1) / P * k, 6 * (P - 1) / P * k), 2 * (P + lg)
            if isinstance(f_units, tuple):
                ok = f_units[0] - 1e-6 <= units <= f_units[1] + 4 * (P - 1)  # + 8-byte stream counts
            else:
                ok = units <= f_units + 4 * (P - 1) + 1e-6
            rows.append({"P": P, "method": label, "rounds": rounds, "formula_rounds": f_rounds,
                         "units": units, "formula_units": f_units, "within": ok})
    return rows


def _fmt_units(u):
    if isinstance(u, tuple):
        return f"[{u[0]:.0f}, {u[1]:.0f}]"
    return f"{u:.0f}" if abs(u - round(u)) < 1e-6 else f"{u:.1f}"


def ledger_markdown(rows, n, k):
    lines = [(f"n = {n}, k = {k} (density {k / n:g}); per rank, max over ranks; units = 4 bytes "
             "(an index or a value). `ok` = measured within the formula's value/bounds."), "",
             "| P | method | rounds | formula | volume (units) | Table I | ok |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['P']} | {r['method']} | {r['rounds']} | {r['formula_rounds']} | "
                     f"{_fmt_units(r['units'])} | {_fmt_units(r['formula_units'])} | "
                     f"{'yes' if r['within'] else 'NO'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- emulated cluster
def cluster_configs(P):
    """``(label, reducer, options)`` timed at world size ``P``."""
    cfg = [("dense", "dense", {}), ("topka", "topka", {}), ("topkdsa", "topkdsa", {})]
    if P & (P - 1) == 0:
        cfg.append(("gtopk", "gtopk", {}))
    # Ok-Topk re-evaluates its thresholds every step here: with a reused step-0 threshold and i.i.d.
    # gradients, error feedback inflates the selection several-fold in the first steps (transient)
    cfg += [("oktopk", "oktopk", {"recompute_every": 1}), ("spardl d=1", "spardl", {})]
    divs = [d for d in range(2, P) if P % d == 0]
    for d in divs:
        if d & (d - 1) == 0:
            cfg.append((f"R-SAG d={d}", "spardl", {"teams": d}))
    odd = [d for d in divs if d & (d - 1)]
    for d in odd or divs[-1:]:
        cfg.append((f"B-SAG d={d}", "spardl", {"teams": d, "team_allgather": "b"}))
    return cfg


def _cluster_worker(comm, numels, densities, steps, warmup, progress):
    from .reducers import make_grad, time_reducer

    torch.set_num_threads(1)
    out = {}
    for n in numels:
        grad = [make_grad(comm.rank, s, n, seed=7) for s in range(min(3, steps + warmup))]  # cycled
        for dens in densities:
            for label, name, opts in cluster_configs(comm.world_size):
                t0 = time.perf_counter()
                recs = time_reducer(comm, name, n, dens, steps=steps, warmup=warmup, grads=grad, **opts)
                out[(n, dens, label)] = recs
                if progress and comm.rank == 0:
                    print(f"  P={comm.world_size} n={n} density={dens:g} {label}: "
                          f"{1e3 * recs[-1]['total_s']:.0f} ms ({time.perf_counter() - t0:.1f} s)",
                          file=sys.stderr, flush=True)
    return out


def run_cluster(world_sizes=(4, 8, 6), numels=(2**24, 25_600_000), densities=(0.01, 0.001), steps=2,
                warmup=1, bandwidth="1gbit", progress=True):
    from ..cluster import run_emulated
    from .reducers import summarize

    rows = []
    for P in world_sizes:
        res = run_emulated(_cluster_worker, P, list(numels), list(densities), steps, warmup, progress,
                           bandwidth=bandwidth, timeout=1200.0)
        for key in res[0]:
            n, dens, label = key
            s = summarize([r[key] for r in res])
            rows.append({"P": P, "numel": n, "density": dens, "method": label,
                         "select_ms": 1e3 * s.get("select_s", 0.0), "comm_ms": 1e3 * s.get("comm_s", 0.0),
                         "total_ms": 1e3 * s["total_s"], "recv_MB": s.get("bytes_received", 0) / 1e6})
    return rows


def cluster_markdown(rows):
    """One table per (P, n, density); R-SAG / B-SAG rows: every d, best marked."""
    out = []
    keys = sorted({(r["P"], r["numel"], r["density"]) for r in rows}, key=lambda x: (x[1], -x[2], x[0]))
    for P, n, dens in keys:
        grp = [r for r in rows if (r["P"], r["numel"], r["density"]) == (P, n, dens)]
        dense = next((r["total_ms"] for r in grp if r["method"] == "dense"), None)
        best = {}
        for kind in ("R-SAG", "B-SAG"):
            c = [r for r in grp if r["method"].startswith(kind)]
            if c:
                best[min(c, key=lambda r: r["total_ms"])["method"]] = True
        out.append(f"**P = {P}, n = {n}, density = {dens:g}**\n")
        out.append("| method | select ms | comm ms | total ms | recv MB/rank | vs dense |")
        out.append("|---|---|---|---|---|---|")
        for r in grp:
            name = r["method"] + (" (best)" if r["method"] in best else "")
            sp = f"{dense / r['total_ms']:.2f}x" if dense else "-"
            out.append(f"| {name} | {r['select_ms']:.0f} | {r['comm_ms']:.0f} | {r['total_ms']:.0f} | "
                       f"{r['recv_MB']:.2f} | {sp} |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sparsync.bench.spardl")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("ledger")
    lp.add_argument("--n", type=int, default=1_008_000)
    lp.add_argument("--k", type=int, default=10_080)
    cp = sub.add_parser("cluster")
    cp.add_argument("--world-sizes", default="4,8,6")
    cp.add_argument("--numels", default=f"{2**24},25600000")
    cp.add_argument("--densities", default="0.01,0.001")
    cp.add_argument("--steps", type=int, default=2)
    cp.add_argument("--warmup", type=int, default=1)
    cp.add_argument("--bandwidth", default="1gbit")
    cp.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "ledger":
        rows = ledger_rows(n=a.n, k=a.k)
        print(ledger_markdown(rows, a.n, a.k))
        return 0 if all(r["within"] for r in rows) else 1
    t0 = time.perf_counter()
    rows = run_cluster([int(x) for x in a.world_sizes.split(",")], [int(float(x)) for x in a.numels.split(",")],
                       [float(x) for x in a.densities.split(",")], a.steps, a.warmup, a.bandwidth)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(cluster_markdown(rows))
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
