"""``auto``: pick a lossless sparse all-reduce from P, k, N and what each candidate costs on this machine.

Rule (documented in ``docs/sparcml.md``), in two steps.

**Model.** Every candidate's cost function with ``pattern="expected"`` (uniformly random indices:
union sizes ``f(k, N, P) = N(1-(1-k/N)^P)``, the dense switch of the wire format included) gives
``rounds``, ``bytes_received`` and the local work on the critical path (``sparse_items`` through
sort-based sparse merges, ``dense_elems`` written by dense operations); the predicted time is

    T = rounds*alpha + bytes_received*beta + sparse_items*gamma_sparse + dense_elems*gamma_dense

Candidates: ``ssar_rec_dbl``, ``ssar_split_allgather``, ``dsar_split_allgather``,
``dsar_early_switch`` (only when ``P' > group_size``, otherwise it is the same as
``dsar_split_allgather``), ``allgather`` (the plain all-gather of every rank's stream, SparCML's
TopkA baseline: ``P-1`` rounds, ``(P-1)`` streams of ``k`` items) and ``dense`` (the ring all-reduce
of the densified vector: ``2(P-1)`` rounds, ``2(P-1)/P * N * isize`` bytes, ``2N`` element writes).
``k`` is the largest item count over ranks (one small unrecorded all-gather of the counts per call,
skipped when the caller passes ``k=``, a bound it guarantees to be the same on every rank: the
``sparcml`` reducer does so for its fixed-size selections), so every rank evaluates the same
formulas on the same numbers. With the network and compute constants given (``alpha=``, ``beta=``,
optional gammas) or on a ThreadComm (its world's ``alpha``/``beta``, a nominal 1 Gbit/s network
when none are set, no compute term: its virtual clock charges none) the candidate with the smallest
``T`` runs (ties: the first in the order above).

**Measurement** (a real backend, constants not given). The model misses what it does not count
(gloo's per-message overheads, page faults, the skew between ranks, a host shared by several ranks),
so on the first call of a new shape - ``(N, k rounded up to a power of two, value dtype, dense or
sparse result)`` - auto times the candidates the model does not rule out (predicted within
``margin`` (3x) of the best, ``allgather`` always, at most 4) on the call's own input: ``trials``
(2) rounds, each candidate after a barrier, every rank's time max-reduced (unrecorded, so the
ledger shows the call that counts), and keeps the fastest (smallest over rounds of the slowest
rank's time) for every later call of that shape. All ranks decide on the same max-reduced numbers,
so they pick the same algorithm. The first call of a shape therefore runs ``trials * candidates + 1``
all-reduces; ``tune=False`` keeps the model's pick.

State (:class:`AutoState`): the calibration and the measured choices of one communicator, owned by
the caller and passed as ``state=``; a call without one makes a fresh state for itself (so it
calibrates and measures every time: a caller that calls more than once passes its own). Nothing is
kept on the comm object or at module level. Calibration (once per state): ranks 0 and 1 ping-pong
8 B and 4 MiB messages (min of 5 round trips), ``beta = (t_big - t_small) / (2 (4 MiB - 8 B))``,
``alpha = t_small/2 - 8 B * beta``, broadcast from rank 0; every rank at the same time times a
sparse merge of 2 x 2^16 items and a dense add of 2^22 elements (so an oversubscribed host is
measured as such), and the maximum over ranks gives ``gamma_sparse``/``gamma_dense``. A caller that
wants to know which algorithm ran passes a dict as the option ``report`` (``ss.sparse_allreduce(sv,
comm, "auto", report=info)`` -> ``info["algorithm"]``, and ``info["timings"]`` when this call
measured); the choice also shows in the ledger, whose phases nest under ``auto/<algorithm>``.
"""

from __future__ import annotations

import time

import torch

from ..sparse import SparseVec, as_dtype, set_at, sum_dtype
from .registry import ALGORITHMS, COSTS, dense_sum, register, zeroed_result
from .sparcml_common import as_stream, densify, index_bytes_for, phase_label

CANDIDATES = ("ssar_rec_dbl", "ssar_split_allgather", "dsar_split_allgather", "dsar_early_switch", "allgather",
              "dense")
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


class AutoState:
    """What ``auto`` knows about one communicator (module docstring): ``calibration`` (alpha, beta,
    gamma_sparse, gamma_dense, or None until measured) and ``choices`` (shape key -> the candidate
    measured fastest; ``timings``: key -> {candidate: seconds}). ``tune``: measure the candidates
    (else the model alone decides); ``trials``: timing rounds; ``margin``: candidates predicted
    within this factor of the best are timed; ``max_candidates``: at most this many."""

    def __init__(self, tune: bool = True, trials: int = 2, margin: float = 3.0, max_candidates: int = 4):
        if trials < 1 or margin < 1 or max_candidates < 1:
            raise ValueError(f"AutoState needs trials >= 1, margin >= 1, max_candidates >= 1, got {trials}, "
                             f"{margin}, {max_candidates}")
        self.tune, self.trials, self.margin, self.max_candidates = bool(tune), int(trials), float(margin), \
            int(max_candidates)
        self.calibration: tuple[float, float, float, float] | None = None
        self.choices: dict = {}
        self.timings: dict = {}

    @staticmethod
    def key(numel: int, k: int, dtype, dense: bool = False, group_size: int = 8) -> tuple:
        """The shape a measured choice is kept for: ``k`` rounded up to a power of two."""
        return int(numel), max(int(k), 1).bit_length(), str(dtype), bool(dense), int(group_size)


def _state(state: AutoState | None) -> AutoState:
    """``state``, or a fresh :class:`AutoState` for this call alone."""
    if state is None:
        return AutoState()
    if not isinstance(state, AutoState):
        raise TypeError(f"auto: state must be an AutoState, got {type(state).__name__}")
    return state


def with_own_state(algorithm: str, options: dict) -> dict:
    """``options``, with ``state=`` a fresh :class:`AutoState` when ``algorithm`` is ``"auto"`` and none is
    given: for a caller that calls ``auto`` many times (calibrated and measured once, then kept)."""
    if algorithm == "auto" and options.get("state") is None:
        return {**options, "state": AutoState()}
    return options


def calibrate(comm, reps: int = 5, big_bytes: int = _BIG_BYTES,
              force: bool = False, state: AutoState | None = None) -> tuple[float, float, float, float]:
    """(alpha [s], beta [s/byte], gamma_sparse [s/item], gamma_dense [s/element]) of this comm.

    Measured once per :class:`AutoState` ``state`` and kept there (module docstring); without
    ``state``, measured on every call.
    """
    st = _state(state)
    if not force and st.calibration is not None:
        return st.calibration
    link = comm.modelled_link()
    if link is not None:
        ab = (link if any(link) else NOMINAL) + (0.0, 0.0)
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
    st.calibration = ab
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


@register("auto", dense=True)
def auto(sv: SparseVec, comm, alpha: float | None = None, beta: float | None = None, group_size: int = 8,
         gamma_sparse: float | None = None, gamma_dense: float | None = None, k: int | None = None,
         report: dict | None = None, state: AutoState | None = None, tune: bool | None = None,
         dense: bool = False, out: torch.Tensor | None = None, out_zeroed: bool = True, **_):
    """The exact sum by the candidate picked for this call (module docstring): a payload, or with
    ``dense=True`` the dense sum in ``out`` (any content when ``out_zeroed=False``). ``state``: the
    caller's :class:`AutoState`, where the calibration and measured choices are kept across calls
    (without one, this call's own fresh state)."""
    name, timings = "ssar_rec_dbl", None
    if comm.world_size > 1:
        name, timings = _pick(sv, comm, alpha, beta, group_size, gamma_sparse, gamma_dense, k, state, tune,
                              dense, out)
    if report is not None:
        report["algorithm"] = name
        if timings is not None:
            report["timings"] = timings
    if comm.world_size == 1:
        x = as_stream(sv)
        if not dense:
            return x
        return _densified(comm, sv, x, out)
    with comm.phase(phase_label(comm, name)):
        return _run(name, sv, comm, group_size, dense, out)


def _densified(comm, sv, x, out):
    buf = zeroed_result(comm, sv, out)
    if isinstance(x, SparseVec):
        return set_at(buf, x.indices, x.values)
    return buf.copy_(x)


def _run(name, sv, comm, group_size, dense, out):
    """One all-reduce of ``sv`` by candidate ``name`` (a payload, or the dense sum in ``out``)."""
    if name == "dense":  # the ring all-reduce of the densified vector, in place in a buffer of our own
        d = _densified(comm, sv, as_dtype(as_stream(sv), sum_dtype(sv.dtype)), out) if dense \
            else densify(as_stream(sv)).to(sum_dtype(sv.dtype))
        return comm.allreduce(d, out=d)
    opts = {"group_size": group_size} if name == "dsar_early_switch" else {}
    if dense:
        return dense_sum(name, sv, comm, out, **opts)
    return ALGORITHMS[name](sv, comm, **opts)


def _pick(sv, comm, alpha, beta, group_size, gamma_sparse, gamma_dense, k, state, tune, dense, out):
    """``(candidate, timings or None)`` for this call: the model's pick with calibrated (or given)
    constants, ``k`` = the largest count over ranks; on a real backend without given constants, the
    measured fastest of the plausible candidates for this shape (timed now on a new shape)."""
    st = _state(state)
    given = (alpha, beta, gamma_sparse, gamma_dense)
    if alpha is not None and beta is not None:
        cal = (alpha, beta, gamma_sparse or 0.0, gamma_dense or 0.0)
    else:
        cal = calibrate(comm, state=st)
    alpha, beta, gamma_sparse, gamma_dense = (c if g is None else g for c, g in zip(cal, given))
    if k is None:
        with comm.unrecorded():
            counts = comm.allgather(torch.tensor([sv.nnz], dtype=torch.int64, device=comm.device))
        k = max(int(c[0]) for c in counts)
    elif sv.nnz > k:
        raise ValueError(f"auto: this rank has {sv.nnz} items, more than the promised k = {k}")
    P, vb = comm.world_size, sv.values.element_size()
    t = predict(P, sv.numel, k, float(alpha), float(beta), vb, group_size, float(gamma_sparse), float(gamma_dense))
    best = min(t, key=lambda name: (t[name], CANDIDATES.index(name)))
    measure = st.tune if tune is None else bool(tune)
    if not measure or comm.modelled_link() is not None or given[0] is not None or given[1] is not None:
        return best, None
    key = st.key(sv.numel, k, sv.dtype, dense, group_size)
    if key not in st.choices:
        names = sorted((n for n in t if n == "allgather" or t[n] <= st.margin * t[best]),
                       key=lambda n: (n != "allgather", t[n], CANDIDATES.index(n)))[: st.max_candidates]
        times = _time_candidates(sv, comm, names, st.trials, group_size, dense, out)
        st.timings[key] = times
        st.choices[key] = min(names, key=lambda n: (times[n], CANDIDATES.index(n)))
        return st.choices[key], times
    return st.choices[key], None


def _time_candidates(sv, comm, names, trials, group_size, dense, out) -> dict[str, float]:
    """Seconds of each candidate on this input: per round, each after a barrier, max over ranks
    (one all-reduce at the end); the smallest over ``trials`` rounds. Unrecorded."""
    local = torch.zeros(trials, len(names), dtype=torch.float64)
    with comm.unrecorded():
        for r in range(trials):
            for i, name in enumerate(names):
                comm.barrier()
                t0 = time.perf_counter()
                res = _run(name, sv, comm, group_size, dense, out)
                if comm.device.type == "cuda":
                    torch.cuda.synchronize(comm.device)
                local[r, i] = time.perf_counter() - t0
                del res
        worst = comm.allreduce(local.reshape(-1).to(comm.device), op="max").cpu().reshape(trials, len(names))
    return {n: float(worst[:, i].min()) for i, n in enumerate(names)}


def auto_cost(P, n, k, value_bytes=4, index_bytes=None, pattern="random", alpha=NOMINAL[0], beta=NOMINAL[1]):
    """The cost of the algorithm auto picks for a nominal (or given) alpha/beta."""
    name = choose(P, n, k, alpha, beta, value_bytes)
    if name == "dense":
        return dense_cost(P, n, k, value_bytes)
    if index_bytes is None:
        index_bytes = index_bytes_for(n)
    return COSTS[name](P, n, k, value_bytes, index_bytes, pattern=pattern)


register("auto", cost=auto_cost, dense=True)(auto)
