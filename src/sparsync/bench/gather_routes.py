"""Equal-size all-gathers: gloo's ring against one batch of direct messages, by message size
(``sparsync bench gather-routes``).

What: every rank gathers a ``uint8`` message of ``size`` bytes (the same size everywhere) through
both routes of :class:`~sparsync.comm.Comm` - ``_allgather`` (the backend's collective: gloo's ring,
``P - 1`` dependent steps) and ``_allgather_direct`` (``P - 1`` sends and receives posted at once) -
alternated call by call, a barrier before each call. One row per size: the median over calls of
the slowest rank's time for each route, and their ratio. The results of the two routes are checked
to be equal.

Why: :data:`sparsync.torchcomm.DIRECT_GATHER_MAX` (up to which size ``TorchComm`` sends the
equal-size gathers of ``allgatherv`` directly) comes from this measurement; it depends on the
network and on how many ranks share a core, so it must be re-measurable.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["gather_routes_worker", "run_gather_routes"]


def gather_routes_worker(comm, sizes: list[int], calls: int, warmup: int) -> dict:
    """One rank: ``{size: {"ring": [s, ...], "direct": [s, ...]}}`` over the timed calls."""
    torch.set_num_threads(1)
    out = {}
    g = torch.Generator().manual_seed(comm.rank)
    for size in sizes:
        t = torch.randint(0, 256, (int(size),), dtype=torch.uint8, generator=g)
        routes = {"ring": comm._allgather, "direct": comm._allgather_direct}
        times = {name: [] for name in routes}
        for i in range(warmup + calls):
            order = list(routes) if i % 2 == 0 else list(routes)[::-1]
            got = {}
            for name in order:
                comm.barrier()
                t0 = time.perf_counter()
                got[name] = routes[name](t)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
            if not all(torch.equal(a, b) for a, b in zip(got["ring"], got["direct"])):
                raise AssertionError(f"rank {comm.rank}: the two routes gathered different bytes at size {size}")
        out[int(size)] = times
    return out


def run_gather_routes(workers: int, sizes: list[int], calls: int = 15, warmup: int = 3, network: str = "loopback",
                      timeout: float = 600.0, fallback_loopback: bool = False) -> list[dict]:
    """Rows ``{network, world_size, bytes, ring_s, direct_s, ratio}`` (median over calls of the max over
    ranks; ``ratio = direct / ring``) on real gloo processes: loopback or the emulated cluster."""
    args = (sizes, calls, warmup)
    if network == "loopback":
        from ..launch import run_local

        res = run_local(gather_routes_worker, workers, *args, backend="gloo", timeout=timeout)
    else:
        from ..cluster import run_emulated

        res = run_emulated(gather_routes_worker, workers, *args, bandwidth=network, timeout=timeout,
                           fallback_loopback=fallback_loopback)
    rows = []
    for size in sizes:
        med = {name: statistics.median(max(r[int(size)][name][i] for r in res) for i in range(calls))
               for name in ("ring", "direct")}
        rows.append({"network": network, "world_size": workers, "bytes": int(size), "ring_s": med["ring"],
                     "direct_s": med["direct"], "ratio": med["direct"] / med["ring"]})
    return rows
