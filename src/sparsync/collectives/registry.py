"""Registry and entry point of the lossless sparse all-reduce algorithms.

``sparse_allreduce(sv, comm, algorithm)`` checks its input once (type, a numel that agrees across
ranks: one small unrecorded all-gather, skipped with ``check=False``), then runs the algorithm
under the ledger phase ``algorithm`` and returns the exact sum as a SparseVec (bitwise identical on
every rank).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..comm import Comm
from ..plugins import Registry
from ..sparse import SparseVec

ALGORITHMS = Registry(__package__, "sparse all-reduce algorithm", skip=("registry",))
#: name -> ``cost(P, n, k, value_bytes=4, index_bytes=4, pattern="random") -> dict`` with keys
#: ``rounds`` and ``bytes_received`` (per rank; a number, or a ``(low, high)`` pair for a bound):
#: the document's alpha-beta formula, used by tests (ledger == formula) and the simulator.
COSTS: dict[str, Callable] = {}


def register(name: str, cost: Callable | None = None):
    """Decorator: ``@register("ssar_rec_dbl", cost=f) def algo(sv, comm, **options) -> SparseVec | Tensor``."""

    def deco(fn):
        ALGORITHMS.add(name, fn)
        if cost is not None:
            COSTS[name] = cost
        return fn

    return deco


def load_all() -> Registry:
    """Import every module of the package so that each registers its algorithms."""
    return ALGORITHMS.load_all()


def sparse_allreduce(sv: SparseVec, comm: Comm, algorithm: str = "auto", check: bool = True,
                     **options) -> SparseVec:
    """Exact sum over ranks of every rank's SparseVec (lossless), identical on every rank."""
    algo = ALGORITHMS.lookup(algorithm)
    if not isinstance(sv, SparseVec):
        raise TypeError(f"sparse_allreduce needs a SparseVec, got {type(sv).__name__} "
                        "(use SparseVec.from_dense for a dense tensor)")
    if check:
        comm.check_same(sv.numel, "SparseVec numel")
    with comm.phase(algorithm):
        out = algo(sv, comm, **options)
    if isinstance(out, torch.Tensor):
        out = SparseVec.from_dense(out)
    return out
