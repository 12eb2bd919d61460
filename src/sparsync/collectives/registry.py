"""Registry and entry points of the lossless sparse all-reduce algorithms.

``sparse_allreduce(sv, comm, algorithm)`` checks its input once (type, a numel that agrees across
ranks: one small unrecorded all-gather, skipped with ``check=False``), then runs the algorithm
under the ledger phase ``algorithm`` and returns the exact sum as a SparseVec (bitwise identical on
every rank).

``sparse_allreduce_dense(sv, comm, algorithm)`` returns the same sum as a dense tensor - what
``sparse_allreduce(...).to_dense()`` gives, bit for bit, without the SparseVec in between: an
algorithm that can sum straight into a dense buffer (``allgather``: every rank's stream
scatter-added as it arrives, no sort) does so, the others' sparse result is written into the buffer
once; the buffer is recycled across calls (no fresh ``numel``-element allocation and its page faults
per call) unless the caller passes its own ``out``.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..comm import Comm
from ..plugins import Registry
from ..recycle import fill_zero, recycled
from ..sparse import SparseVec, set_at, sum_dtype

ALGORITHMS = Registry(__package__, "sparse all-reduce algorithm", skip=("registry",))
#: name -> ``cost(P, n, k, value_bytes=4, index_bytes=4, pattern="random") -> dict`` with keys
#: ``rounds`` and ``bytes_received`` (per rank; a number, or a ``(low, high)`` pair for a bound):
#: the document's alpha-beta formula, used by tests (ledger == formula) and the simulator.
COSTS: dict[str, Callable] = {}
#: algorithms that take ``dense=True, out=<buffer>, out_zeroed=False`` and sum into it themselves
DENSE_NATIVE: set[str] = set()


def register(name: str, cost: Callable | None = None, dense: bool = False):
    """Decorator: ``@register("ssar_rec_dbl", cost=f) def algo(sv, comm, **options) -> SparseVec | Tensor``.

    ``dense=True``: the algorithm also accepts ``dense=True, out=buf, out_zeroed=False`` (``buf``:
    ``sv.numel`` elements of the sum dtype, any content: the algorithm zero-fills it where that costs
    least) and then returns the dense sum in ``buf``."""

    def deco(fn):
        ALGORITHMS.add(name, fn)
        if cost is not None:
            COSTS[name] = cost
        if dense:
            DENSE_NATIVE.add(name)
        return fn

    return deco


def load_all() -> Registry:
    """Import every module of the package so that each registers its algorithms."""
    return ALGORITHMS.load_all()


def _checked(sv, comm: Comm, algorithm: str, check: bool):
    algo = ALGORITHMS.lookup(algorithm)
    if not isinstance(sv, SparseVec):
        raise TypeError(f"sparse_allreduce needs a SparseVec, got {type(sv).__name__} "
                        "(use SparseVec.from_dense for a dense tensor)")
    if check:
        comm.check_same(sv.numel, "SparseVec numel")
    return algo


def sparse_allreduce(sv: SparseVec, comm: Comm, algorithm: str = "auto", check: bool = True,
                     **options) -> SparseVec:
    """Exact sum over ranks of every rank's SparseVec (lossless), identical on every rank."""
    algo = _checked(sv, comm, algorithm, check)
    with comm.phase(algorithm):
        out = algo(sv, comm, **options)
    if isinstance(out, torch.Tensor):
        out = SparseVec.from_dense(out)
    return out


def sparse_allreduce_dense(sv: SparseVec, comm: Comm, algorithm: str = "auto", out: torch.Tensor | None = None,
                           check: bool = True, **options) -> torch.Tensor:
    """Exact sum over ranks of every rank's SparseVec as a dense 1-D tensor of ``sv.numel`` elements
    (dtype: at least float32, :func:`~sparsync.sparse.sum_dtype`), identical on every rank and
    bitwise equal to ``sparse_allreduce(sv, comm, algorithm).to_dense()``; the same ledger.

    ``out``: a contiguous 1-D tensor of ``sv.numel`` elements of that dtype on ``sv``'s device; it
    is overwritten (its old content does not matter) and returned. Without it the result is a
    buffer recycled from a small pool kept on ``comm``: reused by a later call only once nothing
    references it any more (:func:`sparsync.recycle.recycled`), so a result the caller keeps is
    never overwritten, and a training loop that drops it pays no fresh allocation per call.
    """
    _checked(sv, comm, algorithm, check)
    dt = sum_dtype(sv.dtype)
    if out is not None and (not isinstance(out, torch.Tensor) or out.dim() != 1 or out.numel() != sv.numel
                            or out.dtype != dt or out.device != sv.device or not out.is_contiguous()):
        raise ValueError(f"sparse_allreduce_dense: out must be a contiguous 1-D {dt} tensor of {sv.numel} "
                         f"elements on {sv.device}, got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                         f"{'' if not isinstance(out, torch.Tensor) else f' {out.dtype} on {out.device}'}")
    with comm.phase(algorithm):
        return dense_sum(algorithm, sv, comm, out, **options)


def dense_sum(algorithm: str, sv: SparseVec, comm: Comm, out: torch.Tensor | None = None, **options) -> torch.Tensor:
    """:func:`sparse_allreduce_dense` without the input checks and the ledger phase (callers that
    have both: ``auto``, the benchmarks)."""
    algo = ALGORITHMS[algorithm]
    if algorithm in DENSE_NATIVE:  # it zeroes the buffer itself, where it waits for the wire
        return algo(sv, comm, dense=True, out=result_buffer(comm, sv, out), out_zeroed=False, **options)
    return densify_into(algo(sv, comm, **options), comm, sv, out)


def result_buffer(comm: Comm, sv: SparseVec, out: torch.Tensor | None, zero: bool = False) -> torch.Tensor:
    """``out``, or a buffer of ``sv.numel`` elements of the sum dtype from the dense-result pool kept
    on ``comm`` (:func:`~sparsync.recycle.recycled`); zero-filled with ``zero=True``."""
    if out is None:
        pool = comm.__dict__.setdefault("_dense_result_pool", [])
        return recycled(pool, sv.numel, sum_dtype(sv.dtype), sv.device, zero=zero, keep=2)
    return fill_zero(out) if zero else out


def zeroed_result(comm: Comm, sv: SparseVec, out: torch.Tensor | None) -> torch.Tensor:
    """:func:`result_buffer`, zero-filled."""
    return result_buffer(comm, sv, out, zero=True)


def densify_into(res, comm: Comm, sv: SparseVec, out: torch.Tensor | None) -> torch.Tensor:
    """An algorithm's payload as the dense sum: a SparseVec written once into a zero-filled buffer
    (:func:`zeroed_result`); a dense tensor copied into ``out`` when given, else returned as it is
    (in the sum dtype)."""
    dt = sum_dtype(sv.dtype)
    if isinstance(res, SparseVec):
        return set_at(zeroed_result(comm, sv, out), res.indices, res.values)
    if out is not None:
        return out.copy_(res)
    return res if res.dtype == dt else res.to(dt)
