"""``sparsync bench allreduce|reducers|revision|gather-routes``: side-by-side timing tables (median of max over ranks).

``allreduce`` compares the dense all-reduce with lossless sparse all-reduce algorithms
(:mod:`sparsync.bench.allreduce`); ``reducers`` compares lossy reducers end to end
(:mod:`sparsync.bench.reducers`). Both run on loopback or on the emulated cluster
(``--bandwidth 1gbit``; several networks as a comma list), print a table with the speedup over
dense and write every row to ``--csv``. ``--algorithms all`` / ``--reducers all`` pick up every
registered method at run time. ``revision`` times the reducers of an earlier git revision beside the
current ones (:mod:`sparsync.bench.revision`); ``gather-routes`` times an equal-size all-gather by
gloo's ring against direct messages (:mod:`sparsync.bench.gather_routes`).
"""

from __future__ import annotations

import sys
import time


from . import COUNT, COUNTS, DENSITIES, DENSITY, NAMES, NETWORKS, WORKERS_LIST, UsageError, deprecated_alias, doc_text


def _common(p) -> None:
    p.add_argument("--workers", type=WORKERS_LIST, default="4", help="comma list of rank counts")
    deprecated_alias(p, "--world-sizes", "--workers", "workers", WORKERS_LIST)
    p.add_argument("--bandwidth", type=NETWORKS, default="loopback",
                   help="comma list of networks: 'loopback' (no namespaces) or a per-link rate of the "
                        "emulated cluster, e.g. '1gbit', '100mbit', 'none' (namespaces, no limit)")
    p.add_argument("--topology", default=None, metavar="SxR",
                   help="instead of --bandwidth: S sites of R ranks with --intra RATE and --inter RATE "
                        "(docs/cluster.md; the same as --bandwidth SxR@INTRA/INTER)")
    p.add_argument("--intra", default=None, metavar="RATE", help="with --topology: each rank's link in its site")
    p.add_argument("--inter", default=None, metavar="RATE", help="with --topology: each site's uplink")
    p.add_argument("--fallback-loopback", action="store_true",
                   help="when the emulated cluster cannot be built (no root), warn and use loopback")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--timeout", type=float, default=600.0, help="per run_local timeout in seconds")
    p.add_argument("--csv", metavar="FILE", help="write every row to this CSV file")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _topology_networks(args) -> None:
    """``--topology SxR --intra A --inter B`` -> ``args.bandwidth = ["SxR@A/B"]`` (one line on a bad value);
    then ``SPARSYNC_SITES`` is checked against every ``--workers`` (:func:`._preflight.check_site_env`),
    before the first network runs."""
    from ._preflight import check_site_env

    if args.topology is None:
        if args.intra is not None or args.inter is not None:
            raise UsageError("--intra / --inter set the rates of a --topology; without one use --bandwidth RATE")
        check_site_env(args.workers, args.bandwidth)
        return
    from ..sites import Topology

    try:
        t = Topology.parse(args.topology, args.intra, args.inter)
    except ValueError as e:
        raise UsageError(str(e)) from None
    bad = [P for P in args.workers if P != t.world_size]
    if bad:
        raise UsageError(f"--topology {args.topology} has {t.world_size} ranks but --workers asks for {bad[0]}")
    args.bandwidth = [t.spec()]


def _allreduce(args) -> int:
    _topology_networks(args)
    from ..bench.allreduce import expand_algorithms, run_allreduce_bench
    from ..bench.patterns import PATTERNS
    from ..bench.report import fmt_bytes, fmt_ms, fmt_num, fmt_speedup, format_table, write_csv
    from ..cluster import ClusterUnavailable

    patterns = args.patterns
    for p in patterns:
        if p not in PATTERNS:
            raise UsageError(f"unknown pattern {p!r}; choose from {', '.join(PATTERNS)}")
    try:
        algorithms = expand_algorithms(args.algorithms)
    except ValueError as e:
        raise UsageError(str(e)) from None
    ref = args.reference
    if ref not in algorithms:
        algorithms = [ref] + algorithms  # the speedup column needs it
    t0 = time.perf_counter()
    try:
        rows = run_allreduce_bench(args.workers, args.numel, args.densities, patterns, algorithms, args.bandwidth,
                                   repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                                   check=not args.no_check, timeout=args.timeout,
                                   fallback_loopback=args.fallback_loopback, progress=not args.quiet,
                                   dense=args.dense_result, reference=ref)
    except ClusterUnavailable as e:
        print(f"sparsync bench allreduce: {e}", file=sys.stderr)
        return 2
    shown = [dict(r, numel=fmt_num(r["numel"]), density=f"{r['density']:g}", time=fmt_ms(r.get("time_s")),
                  speedup=fmt_speedup(r.get("speedup")), sent=fmt_bytes(r.get("bytes_sent")),
                  rounds=None if r.get("rounds") is None else int(r["rounds"]),
                  ok={True: "yes", False: "NO", None: "-"}[r.get("correct")],
                  note=(r.get("error") or "")[:60] or None) for r in rows]
    cols = [("network", "network"), ("world_size", "P"), ("numel", "numel"), ("density", "density"),
            ("pattern", "pattern"), ("algorithm", "algorithm"), ("time", "time ms"),
            ("speedup", f"vs {ref}"), ("sent", "sent/rank"), ("rounds", "rounds"), ("ok", "exact")]
    if any(r.get("error") for r in rows):
        cols.append(("note", "error"))
    print(format_table(shown, cols, markdown=args.markdown))
    print(f"(median over {args.repeats} repeats of the max over ranks; total {time.perf_counter() - t0:.0f} s)")
    if args.csv:
        write_csv(args.csv, rows, ["network", "world_size", "numel", "density", "pattern", "algorithm",
                                   "time_s", "speedup", "bytes_sent", "bytes_received", "rounds", "messages",
                                   "correct", "max_err", "error", "times_s"])
        print(f"wrote {args.csv}")
    bad = [r for r in rows if r.get("correct") is False]
    for r in bad:
        print(f"WRONG RESULT: {r['algorithm']} at P={r['world_size']} numel={r['numel']} "
              f"density={r['density']} {r['pattern']} (max rel err {r.get('max_err')})", file=sys.stderr)
    return 1 if bad else 0


def _threshold_options(value: str) -> dict:
    """``--hard-threshold``: 'tuned' (no option: the bench tunes it), 'default' or a number."""
    if value == "tuned":
        return {}
    if value == "default":
        return {"hard_threshold": {"threshold": "default"}}
    try:
        t = float(value)
    except ValueError:
        t = 0.0
    if not t > 0 or t == float("inf"):
        raise UsageError(f"--hard-threshold must be 'tuned', 'default' or a number > 0, got {value!r}")
    return {"hard_threshold": {"threshold": t}}


def _reducers(args) -> int:
    _topology_networks(args)
    from ..bench.reducers import expand_reducers, run_reducer_bench
    from ..bench.report import fmt_bytes, fmt_ms, fmt_num, fmt_speedup, format_table, write_csv
    from ..cluster import ClusterUnavailable

    try:
        reducers = expand_reducers(args.reducers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if "dense" not in reducers:
        reducers = ["dense"] + reducers
    t0 = time.perf_counter()
    try:
        rows = run_reducer_bench(reducers, args.workers, args.numel, args.density,
                                 args.bandwidth, steps=args.steps, warmup=args.warmup,
                                 seed=args.seed, timeout=args.timeout, fallback_loopback=args.fallback_loopback,
                                 progress=not args.quiet, pattern=args.pattern, residuals=args.residual,
                                 baselines=args.baselines or (), options=_threshold_options(args.hard_threshold))
    except ValueError as e:
        raise UsageError(str(e)) from None
    except ClusterUnavailable as e:
        print(f"sparsync bench reducers: {e}", file=sys.stderr)
        return 2
    shown = [dict(r, numel=fmt_num(r["numel"]), select=fmt_ms(r.get("select_s")), comm=fmt_ms(r.get("comm_s")),
                  total=fmt_ms(r.get("total_s")), speedup=fmt_speedup(r.get("speedup")),
                  sent=fmt_bytes(r.get("bytes_sent")), achieved=f"{r.get('density', 0):.4g}") for r in rows]
    cols = [("network", "network"), ("world_size", "P"), ("numel", "numel"), ("residual", "residual"),
            ("reducer", "reducer"),
            ("select", "select ms"), ("comm", "comm ms"), ("total", "total ms"), ("speedup", "vs dense"),
            ("sent", "sent/rank"), ("achieved", "density")]
    print(format_table(shown, cols, markdown=args.markdown))
    print(f"(gradients {args.pattern}; target density {args.density:g}; median over {args.steps} steps of the "
          f"max over ranks; total {time.perf_counter() - t0:.0f} s)")
    if args.csv:
        write_csv(args.csv, rows, ["network", "world_size", "numel", "pattern", "residual", "target_density",
                                   "reducer", "select_s",
                                   "comm_s", "total_s", "wall_s", "speedup", "bytes_sent", "bytes_received",
                                   "rounds", "messages", "density", "selected", "steps", "total_s_all",
                                   "intra_bytes", "inter_bytes"])
        print(f"wrote {args.csv}")
    return 0


def _revision(args) -> int:
    _topology_networks(args)
    from ..bench.report import fmt_ms, fmt_num, format_table, write_csv
    from ..bench.revision import run_revision_ab
    from ..cluster import ClusterUnavailable

    if len(args.workers) != 1 or len(args.bandwidth) != 1:
        raise UsageError("bench revision runs one rank count on one network (e.g. --workers 4 --bandwidth 1gbit)")
    t0 = time.perf_counter()
    try:
        rows = run_revision_ab(args.rev, args.reducers, args.workers[0], args.numel, args.density, steps=args.steps,
                               warmup=args.warmup, network=args.bandwidth[0], pattern=args.pattern, seed=args.seed,
                               timeout=args.timeout, fallback_loopback=args.fallback_loopback)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    except ClusterUnavailable as e:
        print(f"sparsync bench revision: {e}", file=sys.stderr)
        return 2
    shown = [dict(r, numel=fmt_num(r["numel"]), old=fmt_ms(r["old_s"]), new=fmt_ms(r["new_s"]),
                  ratio=f"{r['ratio']:.3f}", same="yes" if r["same_result"] else "no") for r in rows]
    cols = [("network", "network"), ("world_size", "P"), ("numel", "numel"), ("reducer", "reducer"),
            ("old", f"{args.rev} ms"), ("new", "current ms"), ("ratio", "current / old"), ("same", "same result")]
    print(format_table(shown, cols, markdown=args.markdown))
    print(f"(gradients {args.pattern}; density {args.density:g}; both versions alternated call by call, residual "
          f"reset before each call; median over {args.steps} steps of the max over ranks; total "
          f"{time.perf_counter() - t0:.0f} s)")
    if args.csv:
        write_csv(args.csv, rows, ["network", "world_size", "numel", "density", "pattern", "reducer", "revision",
                                   "old_s", "new_s", "ratio", "same_result"])
        print(f"wrote {args.csv}")
    return 0


def _gather_routes(args) -> int:
    _topology_networks(args)
    from ..bench.gather_routes import run_gather_routes
    from ..bench.report import fmt_ms, format_table, write_csv
    from ..cluster import ClusterUnavailable

    rows = []
    try:
        for network in args.bandwidth:
            for P in args.workers:
                if P < 2:
                    raise UsageError("bench gather-routes needs at least 2 workers")
                rows += run_gather_routes(P, args.sizes, calls=args.calls, warmup=args.warmup, network=network,
                                          timeout=args.timeout, fallback_loopback=args.fallback_loopback)
    except ClusterUnavailable as e:
        print(f"sparsync bench gather-routes: {e}", file=sys.stderr)
        return 2
    shown = [dict(r, ring=fmt_ms(r["ring_s"]), direct=fmt_ms(r["direct_s"]), ratio=f"{r['ratio']:.2f}") for r in rows]
    cols = [("network", "network"), ("world_size", "P"), ("bytes", "bytes per rank"), ("ring", "ring ms"),
            ("direct", "direct ms"), ("ratio", "direct / ring")]
    print(format_table(shown, cols, markdown=args.markdown))
    print(f"(median over {args.calls} calls of the slowest rank, the two routes alternated, a barrier before each)")
    if args.csv:
        write_csv(args.csv, rows, ["network", "world_size", "bytes", "ring_s", "direct_s", "ratio"])
        print(f"wrote {args.csv}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: sparse all-reduce algorithms, reducers",
                              description=doc_text(__doc__))
    sub = p.add_subparsers(dest="bench_command", metavar="WHAT")

    a = sub.add_parser("allreduce", help="dense all-reduce vs lossless sparse all-reduce algorithms")
    _common(a)
    a.add_argument("--numel", type=COUNTS, default="1e7", help="comma list of vector lengths")
    a.add_argument("--densities", type=DENSITIES, default="0.01,0.001", help="comma list of densities")
    a.add_argument("--patterns", type=NAMES, default="random",
                   help="comma list of random, identical, disjoint, heavy_tail (the reducer benchmark's workload: "
                        "top-k of two alternated heavy-tailed gradients)")
    a.add_argument("--algorithms", default="dense,plain_allgather,allgather,torch_sparse",
                   help="comma list; 'all' = the baselines (dense, dense_reducer, plain_allgather[_reuse|_int64]) + "
                        "every registered algorithm "
                        "(the --reference row is always added)")
    a.add_argument("--repeats", type=int, default=5, help="timed steps per algorithm (default 5)")
    a.add_argument("--warmup", type=int, default=1, help="untimed steps per algorithm (default 1)")
    a.add_argument("--no-check", action="store_true", help="skip the exactness / cross-rank checks")
    a.add_argument("--dense-result", action="store_true",
                   help="make every result dense inside the timed call (the lossless algorithms through "
                        "ss.sparse_allreduce_dense), as a trainer that needs the dense sum does")
    a.add_argument("--reference", default="dense",
                   help="the row the speedup column divides by (default dense; always run)")
    a.set_defaults(func=_allreduce)

    r = sub.add_parser("reducers", help="lossy reducers end to end: select / comm / total time")
    _common(r)
    r.add_argument("--reducers", default="dense,topka", help="comma list or 'all' (dense is always added)")
    r.add_argument("--numel", type=COUNT, default="1e7", help="gradient length")
    r.add_argument("--density", type=DENSITY, default=0.01, help="fraction of entries each sparse reducer sends")
    r.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    r.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    r.add_argument("--pattern", default="normal",
                   help="gradients: 'normal' (3 seeded normal vectors, cycled) or 'heavy_tail' "
                        "(two heavy-tailed gradients per rank, alternated; sparsync.bench.patterns)")
    r.add_argument("--residual", type=NAMES, default="keep",
                   help="comma list of 'keep' (residual carried between calls, steady state) and 'reset' "
                        "(residual zeroed before every call); one table block per mode (default keep)")
    r.add_argument("--baselines", type=NAMES, default=None,
                   help="comma list of rows timed in the same run before the reducers: 'allreduce' (the bare "
                        "gloo all_reduce; then the 'vs dense' column is relative to it) and/or "
                        "'plain_allgather' (the plain all-gather a user writes: int32 indices, one all-gather, one "
                        "index_add_ of the exact top-k)")
    r.add_argument("--hard-threshold", default="tuned",
                   help="hard_threshold's fixed threshold: 'tuned' (default: the k-th largest |g| of each "
                        "rank's first gradient, averaged over ranks - tuned to the target density once, as "
                        "the method requires), 'default' (its own 1/(2 sqrt k), blind to the gradients' "
                        "scale) or a number")
    r.set_defaults(func=_reducers)

    v = sub.add_parser("revision", help="reducers of an earlier git revision vs the current code, same run",
                       description="Both versions of each reducer in one process group, alternated call by "
                                   "call (sparsync.bench.revision): the ratio current/old of one run, to carry "
                                   "figures measured with that revision on another machine over to this code.")
    _common(v)
    v.add_argument("--rev", required=True, help="git revision to compare with (e.g. a commit hash)")
    v.add_argument("--reducers", default="micro", help="comma list of reducers present in both revisions")
    v.add_argument("--numel", type=COUNT, default="1e7", help="gradient length")
    v.add_argument("--density", type=DENSITY, default=0.01, help="fraction of entries each sparse reducer sends")
    v.add_argument("--steps", type=int, default=12, help="timed steps (default 12)")
    v.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    v.add_argument("--pattern", default="heavy_tail", help="gradients: 'heavy_tail' (default) or 'normal'")
    v.set_defaults(func=_revision)

    gr = sub.add_parser("gather-routes", help="equal-size all-gathers: gloo's ring vs direct messages, by size",
                        description="Both routes of an equal-size all-gather alternated call by call "
                                    "(sparsync.bench.gather_routes): where TorchComm's DIRECT_GATHER_MAX comes from.")
    _common(gr)
    gr.add_argument("--sizes", type=COUNTS, default="8,1e4,1e5,2e5,3e5,5e5,8e5",
                    help="comma list of message sizes in bytes per rank")
    gr.add_argument("--calls", type=int, default=15, help="timed calls per route and size (default 15)")
    gr.add_argument("--warmup", type=int, default=3, help="untimed calls (default 3)")
    gr.set_defaults(func=_gather_routes)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
