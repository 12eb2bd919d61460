"""SparCML benchmark: the sparse all-reduce family vs dense all-reduce and torch's sparse all-reduce.

Grid (after the thesis' micro benchmarks, §5.2): ``N = 2^24``, densities 0.1% / 1% / 10%,
``P = 2, 4, 8``, patterns random / identical / disjoint (:func:`sparsync.bench.patterns.make_sparse`),
on the emulated 1 Gbit/s cluster
(:class:`sparsync.cluster.EmulatedCluster`, one network namespace per rank, tbf on every link).
Timing follows :mod:`sparsync.bench.allreduce` (all algorithms of one configuration interleaved in
one process group, barrier before every call, time = max over ranks, median over repeats, the
warm-up call checks exactness and bitwise agreement); on top of it this script records which
algorithm ``auto`` picked (and its calibrated alpha/beta) and the speedups over ``dense`` and over
``torch_sparse``. ``dsar_early_switch`` is left out by default: with ``P <= 8`` and the default
group size 8 it runs exactly ``dsar_split_allgather``.

    flock /tmp/sparsync-bench.lock .venv/bin/python -m sparsync.bench.sparcml --repeats 3 --markdown
"""

from __future__ import annotations

import argparse
import sys
import time

from ..cluster import network_label, open_network
from .allreduce import _summarize_run, allreduce_worker

DEFAULT_ALGOS = ["dense", "torch_sparse", "ssar_rec_dbl", "ssar_split_allgather", "dsar_split_allgather", "auto"]


def sparcml_worker(comm, configs, algorithms, repeats, warmup, seed, label):
    import torch

    from ..collectives.auto import AutoState, calibrate, choose
    from ..select.topk import k_for_density

    recs = []
    st = AutoState()  # auto's calibration and measured choices, for every config of this worker
    for cfg in configs:
        recs += allreduce_worker(comm, [cfg], algorithms, repeats, warmup, seed, True, label, True, auto_state=st)
        if "auto" in algorithms:
            a, b, gs, gd = calibrate(comm, state=st)
            # what auto ran: every pattern gives every rank k items, so auto's k is this one; the choice it
            # measured on its first call of this shape, else the model's
            k = k_for_density(cfg[0], cfg[1])
            pick = st.choices.get(st.key(cfg[0], k, torch.float32)) or choose(
                comm.world_size, cfg[0], k, a, b, gamma_sparse=gs, gamma_dense=gd)
            recs.append({"numel": cfg[0], "density": cfg[1], "pattern": cfg[2], "algorithm": "auto",
                         "kind": "pick", "pick": pick, "alpha": a, "beta": b,
                         "gamma_sparse": gs, "gamma_dense": gd})
    return recs


def run(world_sizes=(2, 4, 8), numel=1 << 24, densities=(0.001, 0.01, 0.1),
        patterns=("random", "identical", "disjoint"), algorithms=DEFAULT_ALGOS, network="1gbit",
        repeats=3, warmup=1, seed=0, timeout=900.0) -> list[dict]:
    from ..launch import run_local

    configs = [(int(numel), float(d), p) for d in densities for p in patterns]
    rows = []
    for P in world_sizes:
        t0 = time.perf_counter()
        with open_network(network, P) as net:
            label = network_label(network, net)
            per_rank = run_local(sparcml_worker, P, configs, list(algorithms), repeats, warmup, seed, label,
                                 backend="gloo", timeout=timeout, placement=net.placement)
        got = _summarize_run(per_rank, configs, list(algorithms), label, P)
        picks = {(r["numel"], r["density"], r["pattern"]): r for r in per_rank[0] if r.get("kind") == "pick"}
        for cfg in configs:
            group = [r for r in got if (r["numel"], r["density"], r["pattern"]) == cfg]
            ts = next((r.get("time_s") for r in group if r["algorithm"] == "torch_sparse"), None)
            for r in group:
                if ts and r.get("time_s"):
                    r["speedup_vs_torch_sparse"] = ts / r["time_s"]
                if r["algorithm"] == "auto" and cfg in picks:
                    r["auto_pick"] = picks[cfg]["pick"]
                    for key in ("alpha", "beta", "gamma_sparse", "gamma_dense"):
                        r[key] = picks[cfg][key]
        rows += got
        print(f"P={P} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


SHORT = {"dense": "dense", "torch_sparse": "torch_sparse", "ssar_rec_dbl": "rec_dbl",
         "ssar_split_allgather": "ssar_split", "dsar_split_allgather": "dsar_split", "auto": "auto"}


def markdown(rows, algorithms=DEFAULT_ALGOS) -> str:
    """One line per (P, density, pattern): median ms of every algorithm, speedups of the best, auto's pick."""
    keys = []
    for r in rows:
        k = (r["world_size"], r["density"], r["pattern"])
        if k not in keys:
            keys.append(k)
    head = ["P", "density", "pattern"] + [f"{SHORT.get(a, a)} ms" for a in algorithms] + \
        ["best", "best vs dense", "best vs torch_sparse", "auto picked", "auto vs dense"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in keys:
        grp = {r["algorithm"]: r for r in rows if (r["world_size"], r["density"], r["pattern"]) == k}
        cells = [str(k[0]), f"{100 * k[1]:g}%", k[2]]
        for a in algorithms:
            r = grp.get(a, {})
            t = r.get("time_s")
            bad = "" if r.get("correct", True) else " (WRONG)"
            cells.append((f"{1e3 * t:.0f}" if t else ("err" if r.get("error") else "-")) + bad)
        sparc = [a for a in algorithms if a not in ("dense", "torch_sparse", "auto") and grp.get(a, {}).get("time_s")]
        best = min(sparc, key=lambda a: grp[a]["time_s"]) if sparc else None
        if best:
            vs_ts = grp[best].get("speedup_vs_torch_sparse")  # absent when torch_sparse was not run
            cells += [SHORT.get(best, best), f"{grp[best].get('speedup', 0):.1f}x",
                      f"{vs_ts:.1f}x" if vs_ts else "-"]
        else:
            cells += ["-", "-", "-"]
        au = grp.get("auto", {})
        cells += [SHORT.get(au.get("auto_pick"), str(au.get("auto_pick"))),
                  f"{au['speedup']:.1f}x" if au.get("speedup") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,4,8")
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--densities", default="0.001,0.01,0.1")
    p.add_argument("--patterns", default="random,identical,disjoint")
    p.add_argument("--algorithms", default=",".join(DEFAULT_ALGOS))
    p.add_argument("--network", default="1gbit", help="per-link rate of the emulated cluster, or loopback")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None)
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    algos = [x for x in a.algorithms.split(",") if x]
    rows = run([int(x) for x in a.world_sizes.split(",")], a.numel, [float(x) for x in a.densities.split(",")],
               a.patterns.split(","), algos, a.network, a.repeats, seed=a.seed)
    if a.csv:
        from .report import write_csv

        write_csv(a.csv, [{k: v for k, v in r.items() if k != "times_s"} for r in rows])
    print(markdown(rows, algos))
    auto_rows = [r for r in rows if r["algorithm"] == "auto" and r.get("alpha")]
    for P in sorted({r["world_size"] for r in auto_rows}):
        r = next(x for x in auto_rows if x["world_size"] == P)
        print(f"\nP={P}: auto calibration alpha = {r['alpha'] * 1e6:.0f} us, "
              f"beta = {r['beta'] * 1e9:.2f} ns/byte ({8 / r['beta'] / 1e9:.2f} Gbit/s), "
              f"gamma_sparse = {r['gamma_sparse'] * 1e9:.0f} ns/item, "
              f"gamma_dense = {r['gamma_dense'] * 1e9:.1f} ns/elem")
    return 0


if __name__ == "__main__":
    sys.exit(main())
