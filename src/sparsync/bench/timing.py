"""Per-step timing of reducers and lossless collectives on one rank, and their summaries.

Why: every benchmark in this project compares methods the same way (``docs/benchmarks.md``):
each timed step starts with a barrier so the ranks begin together (and ends with one, so no rank's
untimed preparation of the next step overlaps another's timed call), the step's time is the MAX over
ranks (the slowest rank gates a synchronous data-parallel step) and a configuration's time is the
MEDIAN over steps (robust to the noise of a shared machine). Bytes come from the ledger
(:mod:`sparsync.comm`), so they are the same on every backend.

* :func:`time_reducer` runs ``make_reducer(name, comm, density, **options)`` for ``warmup + steps``
  steps and returns one dict per timed step: the reducer's ``stats`` after the step (``select_s``,
  ``comm_s``, ``total_s``, ``selected``, ``density``, ``bytes_sent``, ...) plus ``wall_s`` (wall
  time of ``reduce`` measured here).
* :func:`time_collective` does the same for a lossless algorithm of ``sparsync.collectives`` on a
  fixed SparseVec, and for the dense baseline (``algorithm="dense"``: ``comm.allreduce`` of a dense
  vector of the same numel, built before the clock starts - a dense trainer already has it).
* :func:`summarize` reduces ``[rank][step] -> dict`` results: per step max over ranks of the times
  (and bytes), then median over steps; achieved density is the mean over ranks (median over steps).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ..collectives import load_all as load_collectives
from ..collectives.auto import with_own_state
from ..recycle import fill_zero
from ..reducers import make_reducer
from ..sparse import SparseVec

__all__ = ["BASELINES", "MAX_KEYS", "PLAIN", "TIME_KEYS", "collective_fn", "digest", "make_grad", "plain_allgather",
           "summarize", "time_collective", "time_reducer", "timed_steps"]

#: what a user would run instead of a sparse all-reduce (see :func:`collective_fn`)
BASELINES = ("dense", "plain_allgather", "dense_reducer", "plain_allgather_reuse", "plain_allgather_int64")
TIME_KEYS = ("select_s", "comm_s", "total_s", "wall_s")
MAX_KEYS = ("bytes_sent", "bytes_received", "messages", "rounds", "intra_bytes", "inter_bytes")  # by level: hier


def make_grad(rank: int, step: int, numel: int, seed: int = 0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A synthetic dense gradient: standard normal, seeded by ``(seed, rank, step)``."""
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + int(rank)) * 10_007 + int(step) + 1)
    return torch.randn(int(numel), generator=g, dtype=dtype).to(device)


def digest(x) -> str:
    """Short hash of a payload's bytes (SparseVec or tensor): equal digests across ranks = bitwise equal."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(x, SparseVec):
        h.update(x.indices.cpu().numpy().tobytes())
        x = x.values
    h.update(x.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _grad_source(grads, comm, numel, seed) -> Callable[[int], torch.Tensor]:
    if grads is None:
        return lambda step: make_grad(comm.rank, step, numel, seed, device=comm.device)
    if callable(grads):
        return grads
    if isinstance(grads, torch.Tensor):
        return lambda step: grads
    grads = list(grads)
    if not grads:
        raise ValueError("grads is an empty sequence")
    return lambda step: grads[step % len(grads)]


def time_reducer(comm, name: str, numel: int, density: float = 0.01, steps: int = 5, warmup: int = 2,
                 seed: int = 0, grads=None, reset_residual: bool = False, **options) -> list[dict]:
    """Per-step stats of reducer ``name`` on this rank (``steps`` timed steps after ``warmup``).

    ``grads``: None (synthetic normal gradients seeded by ``(seed, rank, step)``), a tensor (reused
    every step), a sequence (cycled) or a callable ``step -> tensor``. Gradients are produced
    before the clock starts. ``reset_residual``: zero the error-feedback residual before every call
    (outside the clock), so every call sees the same kind of input; otherwise it is kept between
    calls (the steady state training sees).
    """
    reducer = make_reducer(name, comm, density=density, **options)
    source = _grad_source(grads, comm, int(numel), seed)
    grad = None

    def before(step):
        nonlocal grad
        grad = source(step)
        if reset_residual and reducer.residual is not None:
            fill_zero(reducer.residual)

    def record(step, wall, _result):
        rec = dict(reducer.stats)
        rec.update(step=step, wall_s=wall, reducer=name)
        return rec

    return timed_steps(comm, lambda: reducer.reduce(grad), steps, warmup, record, before)[0]


def timed_steps(comm, call, steps: int, warmup: int, record, before=None):
    """The one timing loop of this module: ``warmup + steps`` calls of ``call()``, each after
    ``before(step)`` (untimed) and a barrier (the ranks start together), timed on this rank with
    the device synchronised; returns ``([record(i, wall_s, result) for the timed steps], last result)``."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    out, result = [], None
    for step in range(warmup + steps):
        if before is not None:
            before(step)
        # drop the previous call's result first, as a training loop does: a reducer recycles its
        # output buffer only when nothing else references it (Reducer.zeros_output / output_buffer),
        # so holding it across the call would time a fresh full-size allocation instead
        result = None
        comm.barrier()
        t0 = time.perf_counter()
        result = call()
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        wall = time.perf_counter() - t0
        # and end together: a rank done early would otherwise start the next step's untimed
        # preparation (``before``: a residual reset is a full pass over the gradient) while a slower
        # rank's call is still timed - on an oversubscribed host it took that rank's CPU
        comm.barrier()
        if step >= warmup:
            out.append(record(step - warmup, wall, result))
    return out, result


def collective_fn(comm, algorithm: str, sv: SparseVec | None, numel: int | None = None, dense: bool = False,
                  **options) -> Callable[[], object]:
    """A no-argument callable running one lossless all-reduce of ``sv`` (or a baseline).

    Registered algorithms are called directly (no input check, no conversion of a dense result to
    a SparseVec), so timing covers the algorithm only; ``dense=True``: the result made dense the way
    a caller gets it, :func:`sparsync.collectives.sparse_allreduce_dense` (without its input check).
    Baselines (:data:`BASELINES`): ``"dense"``: the bare in-place all-reduce of a dense vector
    (``sv.to_dense()``, or a random vector of ``numel`` elements when ``sv`` is None, built now) -
    one gloo ``all_reduce`` call, what torch DDP does; the buffer is reduced again on every call (the
    values grow by ``P`` per call; the time does not depend on them); ``"dense_reducer"``:
    sparsync's ``dense`` reducer on the same vector (a fresh result every call, input untouched), to
    compare with the bare all-reduce; the plain all-gathers a user writes by hand (dense result),
    :func:`plain_allgather`: ``"plain_allgather"`` (int32 indices, one all-gather, one
    ``index_add_``, a fresh zero vector per call), ``"plain_allgather_reuse"`` (the same into one
    zero-filled vector kept across calls) and ``"plain_allgather_int64"`` (the weaker form: int64
    indices and values in two all-gathers, one ``index_add_`` per rank). ``auto`` without a
    ``state=`` option gets one :class:`~sparsync.collectives.auto.AutoState` that every call of
    the callable shares (calibrated and measured once, as a training loop's calls are).
    """
    if algorithm in BASELINES and options:
        raise TypeError(f"the {algorithm} baseline takes no options, got {', '.join(sorted(options))}")
    if algorithm in ("dense", "dense_reducer"):
        dense_vec = sv.to_dense() if sv is not None else torch.randn(int(numel), device=comm.device)
        if algorithm == "dense_reducer":
            red = make_reducer("dense", comm)
            return lambda: red.reduce(dense_vec)
        return lambda: comm.allreduce(dense_vec, out=dense_vec)
    if algorithm in PLAIN:
        return plain_allgather(comm, sv, **PLAIN[algorithm])
    algos = load_collectives()
    if algorithm not in algos:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(BASELINES)}, {', '.join(sorted(algos))}")
    options = with_own_state(algorithm, options)
    if dense:
        from ..collectives.registry import dense_sum

        return lambda: dense_sum(algorithm, sv, comm, **options)
    fn = algos[algorithm]
    return lambda: fn(sv, comm, **options)


#: the hand-written plain all-gather baselines -> their :func:`plain_allgather` options
PLAIN = {"plain_allgather": {}, "plain_allgather_reuse": {"reuse": True}, "plain_allgather_int64": {"wide": True}}


def plain_allgather(comm, sv: SparseVec, reuse: bool = False, wide: bool = False) -> Callable[[], torch.Tensor]:
    """The plain all-gather sum a competent user writes with ``torch.distributed`` (dense result).

    Per call: one all-gather of the counts (``dist.all_gather`` of one int64), then every rank's
    indices (int32: every index fits, ``numel < 2^31``) and values packed into one byte buffer,
    padded to the largest count, gathered by ONE ``all_gather_into_tensor``, and ONE ``index_add_``
    of the concatenation (in rank order) into a zero vector of ``numel`` - ``torch.zeros`` per call,
    or with ``reuse=True`` one vector kept across calls and zeroed by ``zero_()``. ``wide=True`` is
    the weaker form (int64 indices; indices and values in two all-gathers of per-rank tensors; one
    ``index_add_`` per rank), kept to compare with earlier measurements. The index conversion and
    packing are inside the call (the user's top-k gives int64 indices).
    """
    n, vals = sv.numel, sv.values
    if wide:
        with comm.unrecorded():
            counts = {int(c[0]) for c in comm.allgather(torch.tensor([sv.nnz], device=comm.device))}
        if len(counts) != 1:
            raise ValueError(f"plain_allgather_int64 needs the same nnz on every rank, got {sorted(counts)}")
        idx64 = sv.indices.to(torch.int64)

        def call_wide():
            out = torch.zeros(n, dtype=vals.dtype, device=vals.device)
            for i, v in zip(comm.allgather(idx64), comm.allgather(vals)):
                out.index_add_(0, i, v)
            return out

        return call_wide
    if n > 2**31 - 1:
        raise ValueError(f"plain_allgather packs int32 indices; numel {n} does not fit")
    P, vb = comm.world_size, vals.element_size()
    kept = torch.zeros(n, dtype=vals.dtype, device=vals.device) if reuse else None

    def call():
        k = sv.nnz
        counts = [int(c[0]) for c in comm.allgather(torch.tensor([k], dtype=torch.int64, device=comm.device))]
        m = max(counts)
        send = torch.zeros(m * (4 + vb), dtype=torch.uint8, device=vals.device)
        send[: 4 * k].view(torch.int32).copy_(sv.indices)
        send[4 * m: 4 * m + vb * k].view(vals.dtype).copy_(vals)
        flat = torch.empty(P * send.numel(), dtype=torch.uint8, device=vals.device)
        comm.allgather_into(send, flat)
        rows = flat.view(P, -1)
        idx = rows[:, : 4 * m].contiguous().view(torch.int32)   # [P, m]
        val = rows[:, 4 * m:].contiguous().view(vals.dtype)      # [P, m]
        if min(counts) == m:
            idx, val = idx.reshape(-1), val.reshape(-1)
        else:
            idx = torch.cat([idx[r, :c] for r, c in enumerate(counts)])
            val = torch.cat([val[r, :c] for r, c in enumerate(counts)])
        out = kept.zero_() if reuse else torch.zeros(n, dtype=vals.dtype, device=vals.device)
        return out.index_add_(0, idx, val)

    return call


def time_collective(comm, algorithm: str, sv, steps: int = 5, warmup: int = 2,
                    numel: int | None = None, check: bool = False, **options) -> list[dict]:
    """Per-step wall time and ledger cost of a lossless all-reduce on this rank.

    ``algorithm`` is a name registered in :mod:`sparsync.collectives` (called directly under its
    ledger phase, no input check, so only the algorithm is timed) or a baseline of
    :func:`collective_fn` (``"dense"``: ``comm.allreduce`` of a dense vector of ``sv.numel`` - or
    ``numel`` - elements). ``sv``: a SparseVec, or a list of them used in turn (step ``i`` runs
    input ``i % len``: the heavy-tailed workload's alternated inputs). With ``check=True`` the last step's record
    carries ``digest`` (hash of the output bytes) and ``out_nnz``. ``auto``: one
    :class:`~sparsync.collectives.auto.AutoState` for every input (``state=``, else a fresh one).
    """
    svs = sv if isinstance(sv, (list, tuple)) else [sv]
    options = with_own_state(algorithm, options)
    calls = [collective_fn(comm, algorithm, x, numel=numel, **options) for x in svs]
    step_no = 0
    snap = None

    def before(step):
        nonlocal snap, step_no
        snap, step_no = comm.ledger.snapshot(), step

    def phased():
        with comm.phase(algorithm):
            return calls[step_no % len(calls)]()

    def record(step, wall, _result):
        cost = comm.ledger.since(snap)
        return {"step": step, "algorithm": algorithm, "total_s": wall, "wall_s": wall,
                "bytes_sent": cost["bytes_sent"], "bytes_received": cost["bytes_received"],
                "messages": cost["messages_sent"], "rounds": cost["rounds"]}

    records, result = timed_steps(comm, phased, steps, warmup, record, before)
    if check and records:
        records[-1]["digest"] = digest(result)
        records[-1]["out_nnz"] = int(result.nnz if isinstance(result, SparseVec)
                                     else torch.count_nonzero(result))
    return records


def summarize(per_rank_results: Sequence[Sequence[dict]]) -> dict:
    """``[rank][step] -> dict`` to one dict: per step max over ranks, then median over steps.

    Times (``select_s``, ``comm_s``, ``total_s``, ``wall_s``) and volumes (``bytes_sent``,
    ``bytes_received``, ``messages``, ``rounds``) present in the records are summarised that way;
    ``density`` / ``selected`` (achieved) are the mean over ranks, median over steps. Also returns
    ``steps``, ``world_size`` and ``total_s_all`` (the per-step maxima, for spread).
    """
    if not per_rank_results or not all(per_rank_results):
        raise ValueError("summarize needs at least one step from every rank")
    nsteps = min(len(r) for r in per_rank_results)
    out: dict = {"world_size": len(per_rank_results), "steps": nsteps}
    first = per_rank_results[0][0]
    for key in TIME_KEYS + MAX_KEYS:
        if key in first:
            per_step = [max(float(r[s].get(key, 0.0)) for r in per_rank_results) for s in range(nsteps)]
            out[key] = statistics.median(per_step)
            if key == "total_s":
                out["total_s_all"] = per_step
    for key in ("density", "selected"):
        if key in first:
            per_step = [statistics.fmean(float(r[s][key]) for r in per_rank_results) for s in range(nsteps)]
            out[key] = statistics.median(per_step)
    return out
