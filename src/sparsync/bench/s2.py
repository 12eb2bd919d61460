"""S2 Reducer benchmark: ``s2`` vs ``block_allgather`` vs ``blocksparse`` on the emulated cluster,
and the count sketch's encode/decode cost on this CPU (``docs/benchmarks.md``, "S2 Reducer").

Run: ``python -m sparsync.bench.s2 [--world-sizes 4,8] [--numel 1e7] [--bandwidth 1gbit]``.

Two workloads, the paper's two sources of sparsity (Ge et al. 2021, §2):

* **dense**: flat gradient of ``numel`` fp32 values, block-wise top-K at density 1/32 (the paper's
  "1/32 compression rate"), blocks of 256. The gradient is *structured*: every block has a scale
  ``exp(N(0,1))`` shared by all ranks (layers differ in magnitude the same way on every worker) times
  rank-specific normal noise, so ranks pick overlapping but not identical blocks. ``dense`` (the gloo
  all-reduce of the whole vector) is timed as the reference.
* **embedding**: ``reduce_sparse`` of an ``nn.Embedding(sparse=True)`` gradient of a 33278 x 650 table
  (the LSTM/WikiText-2 vocabulary of the paper's Table) for a batch of 16 x 35 Zipf-distributed
  tokens per rank (uncoalesced, as autograd produces it); ``embedding_density = 0.01``.

Timing follows :mod:`sparsync.bench.reducers`: a barrier before each step, per step the max over
ranks, then the median over steps. ``err`` is the relative L2 error of the step-0 output against the
exact sum of the same selection (``blocksparse``'s output), which is 0 for the lossless baselines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ..reducers import make_reducer
from ..sketch import CountSketch, sketch_columns
from .reducers import _timed_steps, summarize, time_reducer

V, D, TOKENS = 33278, 650, 16 * 35
EXTRA = ("encode_s", "decode_s")


def structured_grad(rank: int, step: int, numel: int, block_size: int = 256) -> torch.Tensor:
    """Shared per-block scale (seed 0) times rank/step-specific noise."""
    nb = -(-numel // block_size)
    scale = torch.randn(nb, generator=torch.Generator().manual_seed(0)).exp()
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(1 + 1000 * rank + step))
    return noise * scale.repeat_interleave(block_size)[:numel]


def embedding_grad(rank: int, step: int) -> torch.Tensor:
    """Uncoalesced sparse gradient of an embedding lookup of Zipf(1.1) tokens (shared word ranks)."""
    g = torch.Generator().manual_seed(7 + 1000 * rank + step)
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.1
    tok = torch.multinomial(p, TOKENS, replacement=True, generator=g)
    vals = torch.randn(TOKENS, D, generator=g)
    return torch.sparse_coo_tensor(tok.view(1, -1), vals, (V, D), check_invariants=False)


def _extra(per_rank, keys=EXTRA) -> dict:
    n = min(len(r) for r in per_rank)
    out = {}
    for k in keys:
        if k in per_rank[0][0]:
            out[k] = statistics.median(max(float(r[s].get(k, 0.0)) for r in per_rank) for s in range(n))
    for k in ("union_blocks", "sketch_cells", "blocks_selected"):
        if k in per_rank[0][0]:
            out[k] = statistics.median(statistics.fmean(float(r[s][k]) for r in per_rank) for s in range(n))
    return out


def _time_sparse(comm, name, grads, steps, warmup, **opts):
    """``reduce_sparse`` timed by the project's one timing loop (:func:`.reducers._timed_steps`:
    barrier, then per-rank wall time of the call), cycling through ``grads``; returns the records
    of the timed steps and the step-0 output (the output of a fresh reducer on ``grads[0]``,
    computed untimed - the same as the timed reducer's first call: the hashes are seeded)."""
    first = make_reducer(name, comm, **opts).reduce_sparse(grads[0])
    r = make_reducer(name, comm, **opts)
    g = None

    def before(step):
        nonlocal g
        g = grads[step % len(grads)]

    def record(_step, wall, _result):
        return dict(r.sparse_stats, wall_s=wall)

    return _timed_steps(comm, lambda: r.reduce_sparse(g), steps, warmup, record, before)[0], first


CONFIGS = [("blocksparse", "blocksparse", {}), ("block_allgather", "block_allgather", {}),
           ("s2", "s2", {}), ("s2 lambda=2", "s2", {"ratio": 2.0}), ("s2 r=3", "s2", {"rows": 3})]


def worker(comm, numel, steps, warmup, block_size, density):
    torch.set_num_threads(1)
    res = {"dense": {}, "embedding": {}}
    grads = [structured_grad(comm.rank, s, numel, block_size) for s in range(3)]
    recs = time_reducer(comm, "dense", numel, density, steps=steps, warmup=warmup, grads=grads)
    res["dense"]["dense"] = (recs, None)
    ref = None
    for label, name, opts in CONFIGS:
        opts = dict(opts, block_size=block_size)
        first = make_reducer(name, comm, density=density, **opts).reduce(grads[0])  # error at step 0
        ref = first if ref is None else ref  # blocksparse: the exact sum of the selection
        recs = time_reducer(comm, name, numel, density, steps=steps, warmup=warmup, grads=grads, **opts)
        res["dense"][label] = (recs, float((first - ref).norm() / ref.norm()))
    egrads = [embedding_grad(comm.rank, s) for s in range(3)]
    ref = None
    for label, name, opts in CONFIGS:
        recs, first = _time_sparse(comm, name, egrads, steps, warmup, embedding_density=0.01, **opts)
        ref = first if ref is None else ref
        res["embedding"][label] = (recs, float((first - ref).norm() / ref.norm()))
    return res


def sketch_costs(ms=(100_000, 1_000_000), rows=(1, 3), union_factor=4, reps=5) -> list[dict]:
    """Median wall time of encode (m elements) and query (``union_factor * m`` elements), lambda = 0.5."""
    torch.set_num_threads(1)
    out = []
    for m in ms:
        idx = torch.randperm(40 * m)[:m]
        vals = torch.randn(m)
        q = torch.randperm(40 * m)[: union_factor * m]
        for r, cached in [(r, c) for r in rows for c in (False, True)]:
            sk = CountSketch(r, sketch_columns(m, r, ratio=0.5), seed=1)
            if cached:
                sk.precompute(40 * m)
            te, tq = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                table = sk.encode(idx, vals)
                te.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sk.query(table, q)
                tq.append(time.perf_counter() - t0)
            out.append({"m": m, "rows": r, "cached": cached, "columns": sk.columns,
                        "encode_s": statistics.median(te),
                        "query_elems": q.numel(), "query_s": statistics.median(tq)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", default="4,8")
    ap.add_argument("--numel", type=float, default=1e7)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--density", type=float, default=1 / 32)
    a = ap.parse_args(argv)
    from ..cluster import run_emulated

    t_start = time.perf_counter()
    print("## sketch encode/decode on this CPU (1 thread, lambda = 0.5, indices < 40m, query of 4m elements)\n")
    print("| m (nonzeros) | rows | hashes | columns | encode ms | query elems | query ms |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in sketch_costs():
        print(f"| {r['m']:.0e} | {r['rows']} | {'tabulated' if r['cached'] else 'on the fly'} | "
              f"{r['columns']} | {r['encode_s'] * 1e3:.1f} | "
              f"{r['query_elems']:.0e} | {r['query_s'] * 1e3:.1f} |")
    sys.stdout.flush()
    for P in [int(x) for x in a.world_sizes.split(",")]:
        res = run_emulated(worker, P, int(a.numel), a.steps, a.warmup, a.block_size, a.density,
                           bandwidth=a.bandwidth, timeout=900)
        for wl in ("dense", "embedding"):
            print(f"\n## P = {P}, {a.bandwidth}, workload {wl}"
                  + (f" (n = {a.numel:.0e}, density {a.density:g}, blocks of {a.block_size})" if wl == "dense"
                     else f" ({V} x {D} table, {TOKENS} tokens per rank)") + "\n")
            print("| reducer | total ms | select ms | comm ms | encode+decode ms | MB received | "
                  "union blocks | sketch cells | rel. error |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for name in res[0][wl]:
                per_rank = [r[wl][name][0] for r in res]
                s, x = summarize(per_rank), _extra(per_rank)
                err = res[0][wl][name][1]
                ed = x.get("encode_s", 0) + x.get("decode_s", 0)
                print(f"| {name} | {s['total_s'] * 1e3:.0f} | {s.get('select_s', 0) * 1e3:.0f} | "
                      f"{s.get('comm_s', 0) * 1e3:.0f} | {ed * 1e3:.0f} | {s['bytes_received'] / 1e6:.2f} | "
                      f"{x.get('union_blocks', float('nan')):.0f} | {x.get('sketch_cells', float('nan')):.0f} | "
                      f"{'-' if err is None else f'{err:.3f}'} |")
            sys.stdout.flush()
    print(f"\n(total benchmark time {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
