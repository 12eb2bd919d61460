"""``auto``: pick a SparCML sparse all-reduce from P, k, N and the measured network/compute costs.

Rule (documented in ``docs/sparcml.md``): every candidate's cost function with
``pattern="expected"`` (uniformly random indices: union sizes ``f(k, N, P) = N(1-(1-k/N)^P)``, the
dense switch of the wire format included) gives ``rounds``, ``bytes_received`` and the local work on
the critical path (``sparse_items`` through sort-based sparse merges, ``dense_elems`` written by dense
operations); the predicted time is

    T = rounds*alpha + bytes_received*beta + sparse_items*gamma_sparse + dense_elems*gamma_dense

and the candidate with the smallest ``T`` runs (ties: the first in the order below). Candidates:
``ssar_rec_dbl``, ``ssar_split_allgather``, ``dsar_split_allgather``, ``dsar_early_switch`` (only
when ``P' > group_size``, otherwise it is the same as ``dsar_split_allgather``) and ``dense`` (the
ring all-reduce of the densified vector: ``2(P-1)`` rounds, ``2(P-1)/P * N * isize`` bytes, ``2N``
element writes), so auto is never *predicted* slower than dense all-reduce. ``k`` is the largest
item count over ranks (one small unrecorded all-gather of the counts per call, skipped when the
caller passes ``k=``, a bound it guarantees to be the same on every rank: the ``sparcml`` reducer does
so for its fixed-size selections), so every rank evaluates the same formulas on the same numbers and
picks the same algorithm.

Parameters: a ThreadComm uses its world's ``alpha``/``beta`` (a nominal 1 Gbit/s network, 50 us and
8 ns/byte, when none are set) and no compute term (its virtual clock charges none). A real backend
calibrates once per comm object (cached, all traffic unrecorded): ranks 0 and 1 ping-pong 8 B and
4 MiB messages (min of 5 round trips), ``beta = (t_big - t_small) / (2 (4 MiB - 8 B))``,
``alpha = t_small/2 - 8 B * beta``, broadcast from rank 0; every rank at the same time times a sparse
merge of 2 x 2^16 items and a dense add of 2^22 elements (so an oversubscribed host is measured as
such), and the maximum over ranks gives ``gamma_sparse``/``gamma_dense``. All four can be passed as
options (``ss.sparse_allreduce(sv, comm, "auto", alpha=1e-4, beta=8e-9)``; gammas default to 0 when
alpha and beta are given). A caller that wants to know which algorithm ran passes a dict as the
option ``report`` (``ss.sparse_allreduce(sv, comm, "auto", report=info)`` -> ``info["algorithm"]``);
the choice also shows in the ledger, whose phases nest under ``auto/<algorithm>``.
"""

from __future__ import annotations

import time
import weakref

import torch

from ..sparse import SparseVec, sum_dtype
from .registry import ALGORITHMS, COSTS, register
from .sparcml_common import as_stream, densify, index_bytes_for, phase_label

CANDIDATES = ("ssar_rec_dbl", "ssar_split_allgather", "dsar_split_allgather", "dsar_early_switch", "dense")
NOMINAL = (50e-6, 8e-9)  # 1 Gbit/s, 50 us per message
NOMINAL_GAMMA = (30e-9, 1e-9)  # sort-based sparse merge per item, dense add per element (one CPU core)

#: Calibration message sizes (bytes) of the ping-pong: a small one that is all latency and a big one
#: that is all bandwidth (4 MiB: ~34 ms at 1 Gbit/s, far above the 50 us latency, yet a short probe).
#: Round values, not tuned: any pair with ``big * beta >> alpha`` gives the same two-point fit.
_SMALL_BYTES, _BIG_BYTES = 8, 4 << 20
#: Calibration compute workload: a dense add of ``_DENSE_ELEMS`` fp32 (16 MiB, at least a typical
#: last-level cache, so it runs mostly from memory like the dense work of a real gradient) and a sort-based
#: merge of two streams of ``_SPARSE_ITEMS`` (64 K, i.e. 1.6 % of that length: the density range
#: where sparse algorithms compete). Round values chosen to keep the one-time probe to a few ms per
#: repeat; the per-item / per-element costs are assumed constant beyond them (not checked).
_DENSE_ELEMS, _SPARSE_ITEMS = 1 << 22, 1 << 16
#: Floors of the fitted alpha/beta: timer noise can make the two-point fit zero or negative; the
#: floors (1 ps/byte = 8 Tbit/s, 0.1 us) are far below any real network, so they only keep T > 0.
_MIN_BETA, _MIN_ALPHA = 1e-12, 1e-7

_calib: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache: one calibration per comm object


def calibrate(comm, reps: int = 5, big_bytes: int = _BIG_BYTES,
              force: bool = False) -> tuple[float, float, float, float]:
    """(alpha [s], beta [s/byte], gamma_sparse [s/item], gamma_dense [s/element]) of this comm.

    Measured once per comm object and cached (see the module docstring).
    """
    if not force and comm in _calib:
        return _calib[comm]
    world = getattr(comm, "world", None)
    if world is not None and hasattr(world, "alpha"):
        ab = ((world.alpha, world.beta) if (world.alpha or world.beta) else NOMINAL) + (0.0, 0.0)
    elif comm.world_size == 1:
        ab = NOMINAL + NOMINAL_GAMMA
    else:
        with comm.unrecorded():
            res = torch.zeros(2, dtype=torch.float64, device=comm.device)
            if comm.rank in (0, 1):
                res = _pingpong(comm, reps, big_bytes)
            res = comm.broadcast(res, 0)
            gam = comm.allreduce(_compute_costs(comm.device), op="max")
        ab = (float(res[0]), float(res[1]), float(gam[0]), float(gam[1]))
    _calib[comm] = ab
    return ab


def _pingpong(comm, reps, big_bytes):
    peer = 1 - comm.rank
    ts = []
    for nbytes in (_SMALL_BYTES, big_bytes):
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=comm.device)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            if comm.rank == 0:
                comm.send(buf, peer, fixed=True)
                comm.recv(peer, nbytes, torch.uint8)
            else:
                comm.recv(peer, nbytes, torch.uint8)
                comm.send(buf, peer, fixed=True)
            best = min(best, time.perf_counter() - t0)
        ts.append(best)
    beta = max((ts[1] - ts[0]) / (2 * (big_bytes - _SMALL_BYTES)), _MIN_BETA)
    alpha = max(ts[0] / 2 - _SMALL_BYTES * beta, _MIN_ALPHA)
    return torch.tensor([alpha, beta], dtype=torch.float64, device=comm.device)


def _compute_costs(device, reps: int = 3) -> torch.Tensor:
    """Per-item cost of a sparse merge (``sparse.add`` of 2 x ``_SPARSE_ITEMS``) and per-element cost
    of a dense add (``_DENSE_ELEMS``), min of ``reps``; every rank measures at the same time."""
    from ..sparse import SparseVec, add

    g = torch.Generator().manual_seed(0)
    n, m = _DENSE_ELEMS, _SPARSE_ITEMS
    a = SparseVec(torch.randperm(n, generator=g)[:m].sort().values.to(device), torch.randn(m).to(device), n)
    b = SparseVec(torch.randperm(n, generator=g)[:m].sort().values.to(device), torch.randn(m).to(device), n)
    x = torch.randn(n, generator=g).to(device)
    gs = gd = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        add(a, b)
        t1 = time.perf_counter()
        y = x + x
        t2 = time.perf_counter()
        gs, gd = min(gs, (t1 - t0) / (2 * m)), min(gd, (t2 - t1) / n)
    del y
    return torch.tensor([gs, gd], dtype=torch.float64, device=device)


def dense_cost(P, n, k=None, value_bytes=4, index_bytes=4, pattern="random"):
    """Ring all-reduce of the dense vector: ``2(P-1)`` rounds, ``2(P-1)/P * N * isize`` bytes;
    compute: densify + the reduction (``2N`` element writes)."""
    return {"rounds": 2 * (P - 1), "bytes_received": 2 * (P - 1) * n * value_bytes // P if P > 1 else 0,
            "compute": {"sparse_items": 0, "dense_elems": 2 * n}}


def predict(P: int, n: int, k: int, alpha: float, beta: float, value_bytes: int = 4,
            group_size: int = 8, gamma_sparse: float = 0.0, gamma_dense: float = 0.0) -> dict[str, float]:
    """Predicted seconds of every candidate (``T = rounds*alpha + bytes*beta + compute``, expected pattern)."""
    from .sparcml_common import pow2_floor

    ib = index_bytes_for(n)
    out = {}
    for name in CANDIDATES:
        if name == "dsar_early_switch" and pow2_floor(P) <= group_size:
            continue
        if name == "dense":
            c = dense_cost(P, n, k, value_bytes)
        elif name == "dsar_early_switch":
            c = COSTS[name](P, n, k, value_bytes, ib, pattern="expected", group_size=group_size)
        else:
            c = COSTS[name](P, n, k, value_bytes, ib, pattern="expected")
        b = c["bytes_received"]
        b = b[1] if isinstance(b, tuple) else b
        w = c.get("compute", {})
        out[name] = (c["rounds"] * alpha + b * beta + gamma_sparse * w.get("sparse_items", 0)
                     + gamma_dense * w.get("dense_elems", 0))
    return out


def choose(P: int, n: int, k: int, alpha: float, beta: float, value_bytes: int = 4, group_size: int = 8,
           gamma_sparse: float = 0.0, gamma_dense: float = 0.0) -> str:
    """The candidate with the smallest predicted time (first in CANDIDATES order on ties)."""
    t = predict(P, n, k, alpha, beta, value_bytes, group_size, gamma_sparse, gamma_dense)
    return min(t, key=lambda name: (t[name], CANDIDATES.index(name)))


@register("auto")
def auto(sv: SparseVec, comm, alpha: float | None = None, beta: float | None = None, group_size: int = 8,
         gamma_sparse: float | None = None, gamma_dense: float | None = None, k: int | None = None,
         report: dict | None = None, **_):
    name = "ssar_rec_dbl"
    if comm.world_size > 1:
        name = _pick(sv, comm, alpha, beta, group_size, gamma_sparse, gamma_dense, k)
    if report is not None:
        report["algorithm"] = name
    if comm.world_size == 1:
        return as_stream(sv)
    with comm.phase(phase_label(comm, name)):
        if name == "dense":
            d = densify(as_stream(sv)).to(sum_dtype(sv.dtype))
            return comm.allreduce(d, out=d)  # in place: d is a fresh tensor of our own
        opts = {"group_size": group_size} if name == "dsar_early_switch" else {}
        return ALGORITHMS[name](sv, comm, **opts)


def _pick(sv, comm, alpha, beta, group_size, gamma_sparse, gamma_dense, k) -> str:
    """The candidate for this call: calibrated (or given) costs, ``k`` = the largest count over ranks."""
    if alpha is not None and beta is not None:
        cal = (alpha, beta, gamma_sparse or 0.0, gamma_dense or 0.0)
    else:
        cal = calibrate(comm)
    given = (alpha, beta, gamma_sparse, gamma_dense)
    alpha, beta, gamma_sparse, gamma_dense = (c if g is None else g for c, g in zip(cal, given))
    if k is None:
        with comm.unrecorded():
            counts = comm.allgather(torch.tensor([sv.nnz], dtype=torch.int64, device=comm.device))
        k = max(int(c[0]) for c in counts)
    elif sv.nnz > k:
        raise ValueError(f"auto: this rank has {sv.nnz} items, more than the promised k = {k}")
    return choose(comm.world_size, sv.numel, k, float(alpha), float(beta), sv.values.element_size(), group_size,
                  float(gamma_sparse), float(gamma_dense))


def auto_cost(P, n, k, value_bytes=4, index_bytes=None, pattern="random", alpha=NOMINAL[0], beta=NOMINAL[1]):
    """The cost of the algorithm auto picks for a nominal (or given) alpha/beta."""
    name = choose(P, n, k, alpha, beta, value_bytes)
    if name == "dense":
        return dense_cost(P, n, k, value_bytes)
    return COSTS[name](P, n, k, value_bytes, index_bytes, pattern=pattern)


register("auto", cost=auto_cost)(auto)
