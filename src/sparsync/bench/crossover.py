"""Sparse-vs-dense summation crossover (SparCML thesis §5.2.5, Figure 5.6): at which density does
summing ``P`` sparse streams cost more than densifying them?

Per ``(P, n, density)``: ``P`` streams of ``k = density * n`` random indices (``bench.patterns``
"random"), summed two ways, each timed as the median of ``repeats`` runs on one thread:

* **sparse**: the pairwise sort-based union of :mod:`sparsync.sparse` (``_sparse_union``, what the
  SSAR algorithms do at every merge), forced to stay sparse whatever the size;
* **dense**: densify and add: one ``index_add_`` per stream into an ``n``-element buffer (``O(n)``
  zeroing + ``O(P k)`` scatter), what DSAR does once a result is dense.

The crossover density is the first grid density at which the sparse sum is not faster (log-linear
interpolation between the two grid points around it). It is compared with the stream format's switch
rule (:func:`sparsync.sparse.sparse_is_smaller`: a result stays sparse while
``nnz (c + isize) < n isize``, i.e. up to a *union* density ``isize / (c + isize)`` = 50 % for int32
indices and fp32 values): the rule is about bytes on the wire, the crossover about summation work,
and the thesis reports the work crossover at about 6.25 %.

CLI (hold the bench lock)::

    flock /tmp/sparsync-bench.lock python -m sparsync.bench.crossover --world-sizes 2,4,8 \\
        --numel 1e5,1e6,1e7 --repeats 5
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from ..sparse import SparseVec, _elem_bytes, _sparse_union, index_dtype_for
from .patterns import make_sparse
from .report import format_table

__all__ = ["DENSITIES", "crossover", "main", "measure", "sum_dense", "sum_sparse", "switch_density"]

DENSITIES = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5)


def sum_sparse(svs: list[SparseVec]) -> SparseVec:
    """Pairwise sparse union in rank order (never switches to dense)."""
    acc = svs[0]
    for sv in svs[1:]:
        acc = _sparse_union(acc, sv)
    return acc


def sum_dense(svs: list[SparseVec]) -> torch.Tensor:
    """Densify-and-add: one scatter-add per stream into a zeroed buffer."""
    out = torch.zeros(svs[0].numel, dtype=svs[0].dtype)
    for sv in svs:
        out.index_add_(0, sv.indices, sv.values)
    return out


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, caches)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def switch_density(numel: int, dtype=torch.float32) -> float:
    """Union density at which the stream format switches to dense (``sparse_is_smaller`` turns False)."""
    vb = _elem_bytes(dtype)
    return vb / (_elem_bytes(index_dtype_for(numel)) + vb)


def measure(P: int, numel: int, density: float, repeats: int = 5, seed: int = 0) -> dict:
    svs = [make_sparse("random", r, P, numel, density, seed) for r in range(P)]
    s = sum_sparse(svs)
    d = sum_dense(svs)
    if not torch.allclose(s.to_dense(), d, rtol=1e-6, atol=1e-6):
        raise AssertionError(f"sparse and dense sums differ (P={P}, n={numel}, density={density})")
    return {"P": P, "numel": numel, "density": density, "union_density": s.nnz / numel,
            "sparse_s": _median_s(lambda: sum_sparse(svs), repeats),
            "dense_s": _median_s(lambda: sum_dense(svs), repeats)}


def crossover(rows: list[dict]) -> float | None:
    """Input density where sparse stops being faster (log-linear interpolation); None if never."""
    rows = sorted(rows, key=lambda r: r["density"])
    prev = None
    for r in rows:
        ratio = r["sparse_s"] / r["dense_s"]
        if ratio >= 1.0:
            if prev is None:
                return r["density"]
            (d0, q0), (d1, q1) = (prev["density"], prev["sparse_s"] / prev["dense_s"]), (r["density"], ratio)
            f = (math.log(1.0) - math.log(q0)) / (math.log(q1) - math.log(q0)) if q1 != q0 else 0.0
            return math.exp(math.log(d0) + f * (math.log(d1) - math.log(d0)))
        prev = r
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync.bench.crossover", description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", default="2,4,8", help="streams summed (P)")
    ap.add_argument("--numel", default="1e5,1e6,1e7")
    ap.add_argument("--densities", default=",".join(str(d) for d in DENSITIES))
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    Ps = [int(x) for x in a.world_sizes.split(",")]
    ns = [int(float(x)) for x in a.numel.split(",")]
    ds = [float(x) for x in a.densities.split(",")]
    summary = []
    for n in ns:
        for P in Ps:
            rows = [measure(P, n, d, a.repeats) for d in ds if round(d * n) >= 1]
            c = crossover(rows)
            at = min(rows, key=lambda r: abs(math.log(r["density"] / c))) if c else None
            one = next((r for r in rows if r["density"] == 0.01), None)
            summary.append({"n": f"{n:.0e}", "P": P,
                            "crossover": "none" if c is None else f"{100 * c:.2f} %",
                            "union at crossover": "-" if at is None else f"{100 * at['union_density']:.2f} %",
                            "switch rule (union)": f"{100 * switch_density(n):.0f} %",
                            "sparse/dense at 1 %": "-" if one is None else f"{one['sparse_s'] / one['dense_s']:.2f}"})
            ratios = "  ".join(f"{r['density']:g}:{r['sparse_s'] / r['dense_s']:.2f}" for r in rows)
            print(f"n={n:.0e} P={P}: {ratios}", file=sys.stderr, flush=True)
    cols = [(k, k) for k in summary[0]]
    print(format_table(summary, cols, markdown=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
