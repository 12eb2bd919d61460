"""``sparsync cluster smoke|cleanup``: check the emulated network, remove leftovers of crashed runs.

``smoke`` builds an :class:`~sparsync.cluster.EmulatedCluster`, runs a correctness all-reduce and a
timed dense all-reduce on it and prints the measured throughput per link next to the ring model
(``2(P-1)/P * bytes`` over each link, docs/cluster.md). ``cleanup`` deletes every namespace
with the ``ssync`` prefix whose creating process is gone, ends rank processes (``ss<pid>r<rank>``)
whose launcher is gone and removes their ``sparsync-store-<pid>-*`` directories (``--all``: also
those of live runs).
"""

from __future__ import annotations

import sys
import time


def _smoke_worker(comm, numel, repeats, pairs=()):
    import torch

    P = comm.world_size
    x = torch.full((numel,), float(comm.rank + 1))
    out = comm.allreduce(x)
    expect = P * (P + 1) / 2
    ok = bool(torch.all(out == expect))
    times = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce(x)
        times.append(time.perf_counter() - t0)
    return ok, times, {pair: _stream(comm, x, *pair, repeats) for pair in pairs}


def _stream(comm, x, src, dst, repeats) -> list[float]:
    """Seconds of one ``x`` sent ``src`` -> ``dst`` (the other ranks idle), measured at the receiver from
    a barrier: an iperf-like one-flow measurement of the link rate between two ranks."""
    times = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        if comm.rank == src:
            comm.send(x, dst, fixed=True)
        elif comm.rank == dst:
            comm.recv(src, x.numel())
        times.append(time.perf_counter() - t0)
    return times


def _smoke(args) -> int:
    import statistics

    from ..cluster import ClusterUnavailable, format_bandwidth, open_network
    from ..launch import run_local

    from .bench import _topology_networks

    args.bandwidth = [args.bandwidth]
    if args.workers is None and args.topology:
        from ..sites import _grid

        g = _grid(args.topology)
        args.workers = g[0] * g[1] if g else 2
    args.workers = [args.workers or 2]
    _topology_networks(args)
    network, P, n = args.bandwidth[0], args.workers[0], int(float(args.numel))
    topo = None
    if args.topology:
        from ..sites import Topology

        topo = Topology.from_spec(network)
    # point-to-point streams: rank 0 -> 1 (a host link; inside a site), and rank 0 -> the first rank of site 1
    pairs = [(0, 1)] if P > 1 else []
    if topo is not None and topo.sites > 1:
        pairs = ([(0, 1)] if topo.ranks_per_site > 1 else []) + [(0, topo.ranks_per_site)]
    t0 = time.perf_counter()
    try:
        with open_network(network, P, args.fallback_loopback) as cl:
            setup = time.perf_counter() - t0
            print(f"{cl}  (set up in {setup * 1e3:.0f} ms)")
            if cl.emulated:
                print(f"rank 0 routes: {cl.ns_exec(0, 'ip', 'route').strip() or '(none)'}")
            res = run_local(_smoke_worker, P, n, args.repeats, pairs, backend="gloo", timeout=args.timeout,
                            placement=cl.placement)
    except ClusterUnavailable as e:
        print(f"sparsync cluster smoke: {e}", file=sys.stderr)
        return 2
    ok = all(r[0] for r in res)
    per_step = [max(r[1][i] for r in res) for i in range(args.repeats)]
    t = statistics.median(per_step)
    link_bytes = 2 * (P - 1) / P * n * 4 if P > 1 else 0
    print(f"all-reduce of {n:.3g} float32 on {P} ranks: {'correct' if ok else 'WRONG RESULT'}; "
          f"median {t * 1e3:.1f} ms (max over ranks, {args.repeats} repeats)")
    for (src, dst) in pairs:
        ts = statistics.median(res[dst][2][src, dst])
        where = "host link"
        if topo:
            where = "between sites" if topo.site_of(src) != topo.site_of(dst) else "inside a site"
        print(f"stream rank {src} -> rank {dst} ({where}): {n * 4 / 1e6:.1f} MB in {ts * 1e3:.1f} ms = "
              f"{n * 32 / ts / 1e9:.3f} Gbit/s (median of {args.repeats}, at the receiver)")
    if topo is not None:
        return 0 if ok else 1  # the ring model below is for one switch
    if link_bytes:
        print(f"throughput per link: {link_bytes * 8 / t / 1e9:.3f} Gbit/s "
              f"({link_bytes / 1e6:.1f} MB each way per rank, ring model)")
        if cl.bandwidth:
            model = link_bytes * 8 / cl.bandwidth
            print(f"model at {format_bandwidth(cl.bandwidth)}: {model * 1e3:.1f} ms "
                  f"-> measured/model = {t / model:.2f}")
    return 0 if ok else 1


def _cleanup(args) -> int:
    from ..cluster import cleanup_stale, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        print(f"sparsync cluster cleanup: namespaces skipped ({reason}); rank processes and stores only",
              file=sys.stderr)
    removed = cleanup_stale(all_instances=args.all, namespaces=reason is None)
    if removed:
        print("removed: " + ", ".join(removed))
    else:
        print("nothing to clean up")
    return 0


def register(subparsers) -> None:
    from . import doc_text

    p = subparsers.add_parser("cluster", help="emulated bandwidth-limited cluster (network namespaces)",
                              description=doc_text(__doc__))
    sub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    s = sub.add_parser("smoke", help="all-reduce on an emulated cluster and print the throughput")
    from . import NETWORK, WORKERS, deprecated_alias

    s.add_argument("--workers", type=WORKERS, default=None, help="number of ranks (default 2, or the topology's)")
    deprecated_alias(s, "--world-size", "--workers", "workers", WORKERS)
    s.add_argument("--bandwidth", type=NETWORK, default="1gbit",
                   help="per-link rate, e.g. 1gbit, 100mbit; 'none' = namespaces without a limit; "
                        "'loopback' = no namespaces (default 1gbit)")
    s.add_argument("--topology", default=None, metavar="SxR",
                   help="S sites of R ranks (--workers S*R) joined by shaped uplinks: needs --intra and --inter")
    s.add_argument("--intra", default=None, metavar="RATE", help="with --topology: each rank's link in its site")
    s.add_argument("--inter", default=None, metavar="RATE", help="with --topology: each site's uplink")
    s.add_argument("--numel", default="2.5e6", help="float32 elements to all-reduce (default 2.5e6 = 10 MB)")
    s.add_argument("--repeats", type=int, default=3, help="timed all-reduces")
    s.add_argument("--timeout", type=float, default=120.0, help="seconds before the ranks are stopped")
    s.add_argument("--fallback-loopback", action="store_true",
                   help="run on loopback (with a warning) when namespaces cannot be created")
    s.set_defaults(func=_smoke)
    c = sub.add_parser("cleanup", help="remove namespaces, rank processes and stores left by crashed runs")
    c.add_argument("--all", action="store_true", help="also remove those of runs still alive")
    c.set_defaults(func=_cleanup)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
