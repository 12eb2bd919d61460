"""Per-phase profile of the lossless all-reduces against the user's plain all-gather (emulated 1 Gbit/s).

Each rank wraps the phase functions of the algorithms (encode/decode, the split phase, the sparse
sums, the all-gather steps, the dense writes, the comm calls) with timers, runs every algorithm on
the heavy-tailed inputs (two alternated, as ``sparsync bench allreduce --patterns heavy_tail``) and
prints, per algorithm, the median over steps of the slowest rank's wall time and the median over
ranks of each phase's mean time (ms; nested phases overlap: ``direct_split_sum`` contains
``sum_streams``, which contains ``coalesce_in_order``). ``name+dense``: the result made dense
(``sparse_allreduce_dense``). Usage::

    flock /tmp/sparsync-bench.lock python tools/lossless_phases.py P N DENSITY ALGOS [STEPS]
    flock /tmp/sparsync-bench.lock python tools/lossless_phases.py 4 1e7 0.01 \\
        plain_allgather,allgather+dense,ssar_split_allgather+dense 7
"""
import collections
import statistics
import sys
import time

from sparsync.bench.patterns import make_sparse
from sparsync.bench.reducers import collective_fn
from sparsync.cluster import run_emulated
from sparsync.sparse import SparseVec

#: module -> the functions of it that are timed (every name found there is wrapped)
WRAP = {
    "sparsync.sparse": ["encode", "decode", "sum_streams", "coalesce_in_order", "sum_in_rank_order", "set_at",
                        "add_at"],
    "sparsync.collectives.sparcml_common": ["encode", "decode", "sum_streams", "split_stream", "concat",
                                            "exchange_stream", "direct_split_sum", "allgather_concat", "set_at",
                                            "write_block"],
    "sparsync.collectives.ssar_split_allgather": ["fill_zero"],
    "sparsync.collectives.allgather": ["encode", "decode", "sum_streams", "sum_in_rank_order", "decode_views",
                                       "add_at", "fill_zero"],
    "sparsync.collectives.registry": ["zeroed_result", "set_at", "densify_into"],
}
COMM_METHODS = ("allgatherv", "allgatherv_flat", "allgather", "allgather_into", "exchange_sizes", "post",
                "sendrecv", "gather_counts", "_allgather_equal")


def worker(comm, n, density, algos, steps):
    import importlib

    acc = collections.defaultdict(float)

    def wrap(name, f):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t0
        return timed

    for mod, names in WRAP.items():
        m = importlib.import_module(mod)
        for nm in names:
            if hasattr(m, nm):
                setattr(m, nm, wrap(nm, getattr(m, nm)))
    cls = type(comm)
    for meth in COMM_METHODS:
        if hasattr(cls, meth):
            setattr(cls, meth, wrap("comm." + meth, getattr(cls, meth)))
    SparseVec.to_dense = wrap("to_dense", SparseVec.to_dense)
    svs = [make_sparse("heavy_tail", comm.rank, comm.world_size, n, density, 0, variant=j) for j in range(2)]
    res = {}
    for a in algos:
        dense = a.endswith("+dense")
        calls = [collective_fn(comm, a.removesuffix("+dense"), sv, dense=dense) for sv in svs]
        per = []
        for s in range(steps + 1):  # step 0: warm-up
            acc.clear()
            comm.barrier()
            t0 = time.perf_counter()
            out = calls[s % 2]()
            w = time.perf_counter() - t0
            comm.barrier()
            del out
            if s:
                per.append(dict(acc, wall=w))
        res[a] = per
    return res


def main():
    P, n, d = int(sys.argv[1]), int(float(sys.argv[2])), float(sys.argv[3])
    algos = sys.argv[4].split(",")
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    out = run_emulated(worker, P, n, d, algos, steps, bandwidth="1gbit", timeout=900)
    for a in algos:
        walls = [max(r[a][s]["wall"] for r in out) for s in range(steps)]
        keys = sorted({k for r in out for st in r[a] for k in st if k != "wall"})
        phases = {k: statistics.median(statistics.fmean(st.get(k, 0) for st in r[a]) for r in out) * 1e3
                  for k in keys}
        print(f"{a:28s} wall {statistics.median(walls) * 1e3:7.1f} ms "
              f"[{min(walls) * 1e3:.1f}-{max(walls) * 1e3:.1f}]  "
              + " ".join(f"{k}={v:.1f}" for k, v in phases.items()))


if __name__ == "__main__":
    main()
