"""``sparsync bench-select``: selection cost, density tracking and communication of the threshold
sparsifiers (MiCRO, hard threshold, CLT-k, TopkA) - ``docs/benchmarks.md``, "Selection kernels".

Parts (``--parts``, default the first three):

* ``exact`` - the exact top-k kernel against ``torch.topk`` on the heavy-tailed benchmark gradient,
  side by side, at each ``--sizes`` x ``--densities`` (:func:`sparsync.bench.selection.compare_exact_topk`).

* ``chunked`` - SparseLoCo's per-chunk top-k (4096-entry chunks, ``k = density x 4096``) and the sum of
  ``--partitions`` 2-bit messages, C kernels against torch (:func:`sparsync.bench.selection.compare_chunked`).
* ``selection`` - exact top-k vs threshold (naive and chunked kernel) vs MiCRO's partitioned
  threshold at each ``--sizes`` x ``--densities`` (:func:`sparsync.bench.selection.time_selection`).
* ``trace`` - achieved density vs step of micro and hard_threshold on the digits-MLP gradient stream
  (4 thread ranks); ``--plot`` writes the PNG.
* ``comm`` - per-step time of the reducers on ``--world-sizes`` ranks on the emulated cluster
  (``--bandwidth``, needs root; ``loopback`` for plain gloo).

Run it under the shared benchmark lock: ``flock /tmp/sparsync-bench.lock sparsync bench-select``.
"""

from __future__ import annotations

import sys

from . import UsageError, doc_text


def register(subparsers) -> None:
    from . import COUNT, COUNTS, DENSITIES, DENSITY, NAMES, NETWORK, WORKERS, WORKERS_LIST, deprecated_alias

    p = subparsers.add_parser("bench-select", help="selection cost and density of MiCRO / threshold sparsifiers",
                              description=doc_text(__doc__.split("\n\n")[0]))
    p.add_argument("--parts", type=NAMES, default="selection,trace,comm",
                   help="comma list of exact, chunked, selection, trace, comm")
    p.add_argument("--sizes", type=COUNTS, default="1e6,1e7,1e8",
                   help="vector lengths for the exact and selection parts")
    p.add_argument("--densities", type=DENSITIES, default="0.01,0.001",
                   help="densities for the exact and selection parts")
    p.add_argument("--partitions", type=WORKERS, default=4, help="P for MiCRO's partitioned selection")
    p.add_argument("--repeat", type=WORKERS, default=5, help="timed repetitions per kernel (median)")
    p.add_argument("--device", default="cpu", help="device for the selection part (cpu, cuda)")
    p.add_argument("--trace-steps", type=WORKERS, default=200, help="steps of the density trace")
    p.add_argument("--plot", metavar="PNG", help="write the density-vs-step plot here")
    p.add_argument("--workers", type=WORKERS_LIST, default="4,8", help="rank counts for the comm part")
    deprecated_alias(p, "--world-sizes", "--workers", "workers", WORKERS_LIST)
    p.add_argument("--numel", type=COUNT, default="1e7", help="gradient length for the comm part")
    p.add_argument("--density", type=DENSITY, default=0.01, help="density for the trace and comm parts")
    p.add_argument("--bandwidth", type=NETWORK, default="1gbit", help="emulated link rate, or 'loopback'")
    p.add_argument("--reducers", type=NAMES, default="dense,micro,cltk,topka,hard_threshold",
                   help="comma list; options after a colon, ';'-separated: 'micro:rule=adaptive'")
    p.add_argument("--steps", type=WORKERS, default=5, help="timed steps per reducer in the comm part")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per reducer in the comm part")
    p.set_defaults(func=_main)


def _row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _main(args) -> int:
    import torch

    from ..bench import selection as bs

    torch.set_num_threads(1)
    parts = set(args.parts)
    bad = parts - set(_PARTS)
    if bad:
        raise UsageError(f"--parts: unknown {', '.join(sorted(bad))}; valid: {', '.join(_PARTS)}")
    for name, part in _PARTS.items():
        if name in parts:
            part(args, bs)
    return 0


def _exact(args, bs) -> None:
    """Exact top-k kernel vs torch.topk, per size and density."""
    print(f"\n### Exact top-k vs torch.topk ({args.device}, 1 thread; alternated, median of {args.repeat}; ms)\n")
    from .. import native

    kernel = "exact kernel (C pass)" if native.enabled() else f"exact kernel ({native.info()['why']})"
    print(_row(["n", "density", "k", "torch.topk (+ sort of k)", kernel, "speed-up", "exact kernel, torch pass",
                "same set"]))
    print(_row(["---"] * 8))
    for n in args.sizes:
        for d in args.densities:
            r = bs.compare_exact_topk(n, d, repeat=args.repeat, device=args.device)
            print(_row([f"{n:.3g}", d, r["k"], f"{r['topk_s'] * 1e3:.1f}", f"{r['exact_s'] * 1e3:.1f}",
                        f"{r['speedup']:.1f}x", f"{r['exact_torch_s'] * 1e3:.1f}", r["same_set"]]))
            sys.stdout.flush()


def _chunked(args, bs) -> None:
    """SparseLoCo's chunked top-k and message sum, C against torch."""
    print(f"\n### SparseLoCo's kernels, C vs torch (1 thread; alternated, median of {args.repeat}; ms)\n")
    print(_row(["n", "k of 4096", "chunked top-k: torch", "C", "speed-up",
                f"sum of {args.partitions} 2-bit messages: torch", "C", "speed-up", "same bits"]))
    print(_row(["---"] * 9))
    for n in args.sizes:
        for d in args.densities:
            r = bs.compare_chunked(n, d, P=args.partitions, repeat=args.repeat)
            print(_row([f"{n:.3g}", r["k"], f"{r['topk_torch_s'] * 1e3:.1f}", f"{r['topk_c_s'] * 1e3:.1f}",
                        f"{r['topk_torch_s'] / r['topk_c_s']:.1f}x", f"{r['sum_torch_s'] * 1e3:.1f}",
                        f"{r['sum_c_s'] * 1e3:.1f}", f"{r['sum_torch_s'] / r['sum_c_s']:.1f}x", r["same"]]))
            sys.stdout.flush()


def _selection(args, bs) -> None:
    """Selection cost of each selector (single process)."""
    print(f"\n### Selection cost ({args.device}, 1 thread; median of {args.repeat}; ms)\n")
    from .. import native

    print(_row(["n", "density", "exact top-k", "threshold naive",
                "threshold kernel" + (" (C pass)" if native.enabled() else ""), "threshold kernel, torch pass",
                f"MiCRO partition (1/{args.partitions})"]))
    print(_row(["---"] * 7))
    for n in args.sizes:
        for d in args.densities:
            try:
                rows = bs.time_selection(n, d, P=args.partitions, repeat=args.repeat, device=args.device)
            except RuntimeError as e:  # out of memory at 1e8 and the like
                print(_row([f"{n:.0e}", d, f"failed: {e}"[:60], "", "", "", ""]))
                continue
            t = {r["selector"]: r["time_s"] * 1e3 for r in rows}
            print(_row([f"{n:.0e}", d] + [f"{t[s]:.2f}" for s in bs.SELECTORS]))
            sys.stdout.flush()


def _trace(args, bs) -> None:
    """Achieved density per step of the threshold rules on a real workload (4 thread ranks)."""
    from ..launch import run_local

    steps = args.trace_steps
    if steps < 2:
        raise UsageError("--trace-steps must be >= 2")
    variants = [("micro (histogram, default)", "micro", {}),
                ("micro rule=adaptive", "micro", {"rule": "adaptive"}),
                ("micro rule=micro (authors)", "micro", {"rule": "micro"}),
                ("micro rule=micro (authors), from the first k-th value", "micro",
                 {"rule": "micro", "threshold": "first_kth"}),
                ("hard_threshold", "hard_threshold", {})]
    res = run_local(lambda c: bs.density_trace(c, reducers=variants, steps=steps, density=args.density), 4)
    tr = res[0]
    d = args.density
    print(f"\n### Achieved density, digits MLP ({tr['numel']} parameters), 4 ranks, lr * grad, target {d}\n")
    skip = min(50, steps // 2)
    print(_row(["reducer", "within 10% from step", f"steps {skip}+: min", "median", "max",
                f"share of steps {skip}+ within 10%"]))
    print(_row(["---"] * 6))
    for label, _, _ in variants:
        m = tr[label]["density"]
        first = next((i for i in range(len(m)) if all(abs(x / d - 1) <= 0.1 for x in m[i:])), "never")
        tail = m[skip:]
        share = sum(abs(x / d - 1) <= 0.1 for x in tail) / len(tail)
        print(_row([label, first, f"{min(tail):.5f}", f"{sorted(tail)[len(tail) // 2]:.5f}",
                    f"{max(tail):.5f}", f"{share:.0%}"]))
    if args.plot:
        bs.plot_density({label: tr[label] for label, _, _ in variants}, d, args.plot,
                        title=f"digits MLP, {tr['numel']} params, 4 ranks, target {d}")
        print(f"\nplot: {args.plot}")


def _comm(args, bs) -> None:
    """Reducers end to end on gloo ranks: total, select and comm time, density, bytes."""
    bw = None if args.bandwidth == "loopback" else args.bandwidth
    n = args.numel
    names = args.reducers
    print(f"\n### Reducers, n = {n:.0e}, density {args.density}, {args.bandwidth}; median of max over ranks (ms)\n")
    print(_row(["P", "reducer", "total", "select", "comm", "achieved density", "MB received / rank"]))
    print(_row(["---"] * 7))
    for P in args.workers:
        rows = bs.comm_benchmark(P, n, args.density, reducers=names, steps=args.steps, warmup=args.warmup,
                                 bandwidth=bw)
        for r in rows:
            print(_row([P, r["reducer"], f"{r['total_s'] * 1e3:.1f}", f"{r.get('select_s', 0) * 1e3:.1f}",
                        f"{r.get('comm_s', 0) * 1e3:.1f}", f"{r.get('density', float('nan')):.4f}",
                        f"{r.get('bytes_received', 0) / 1e6:.2f}"]))
            sys.stdout.flush()


_PARTS = {"exact": _exact, "chunked": _chunked, "selection": _selection, "trace": _trace, "comm": _comm}  # print order
