"""Flat reducer against `hier` (inner dense, outer the same reducer), same density, alternated call by
call in one process group of an emulated sites cluster; per call the max over ranks, then the median.

usage: python tools/hier_ab.py [--numel N] NETWORK:REDUCER[:STEPS] ...   e.g. 2x2@none/200mbit:micro
(root: namespaces); --numel: gradient size (default 1e7; the digits MLP has 4349962)
"""
import statistics
import sys
import time
from sparsync.bench.reducers import bench_grads
from sparsync.cluster import run_emulated
from sparsync.reducers.registry import make_reducer

N, DENS, WARM = int(1e7), 0.01, 2

def worker(comm, base, steps, n):
    grads = bench_grads("heavy_tail", comm.rank, n, 0, 2, comm.device)
    reds = {base: make_reducer(base, comm, DENS), "hier": make_reducer("hier", comm, DENS, outer=base)}
    out = {k: [] for k in reds}
    for step in range(WARM + steps):
        for name, r in reds.items():
            g = grads[step % 2]
            comm.barrier()
            t0 = time.perf_counter()
            r.reduce(g)
            dt = time.perf_counter() - t0
            if step >= WARM:
                st = r.stats
                out[name].append((dt, st.get("bytes_sent"), st.get("inter_bytes"), st.get("intra_bytes")))
    return out

args = sys.argv[1:]
if args[:1] == ["--numel"]:
    N, args = int(float(args[1])), args[2:]
for spec in args:
    net, base, *st = spec.split(":")
    steps = int(st[0]) if st else 10
    res = run_emulated(worker, 4, base, steps, N, bandwidth=net, timeout=900)
    row = {}
    for name in (base, "hier"):
        per = [max(res[r][name][i][0] for r in range(4)) for i in range(steps)]
        row[name] = statistics.median(per)
        b = res[0][name][-1]
        what = f"hier(outer {base})" if name == "hier" else f"{base} flat"
        print(f"{net} {what}: median {row[name]*1e3:.1f} ms (calls {min(per)*1e3:.0f}-{max(per)*1e3:.0f}), "
              f"rank 0 sent {b[1]/1e6:.2f} MB, inter {b[2]}, intra {b[3]}", flush=True)
    print(f"{net} {base}: hier / flat = {row['hier']/row[base]:.2f}", flush=True)
