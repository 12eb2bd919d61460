"""Registry and entry point of the lossless sparse all-reduce algorithms.

``sparse_allreduce(sv, comm, algorithm)`` checks its input once (type, a numel that agrees across
ranks: one small unrecorded all-gather, skipped with ``check=False``), then runs the algorithm
under the ledger phase ``algorithm`` and returns the exact sum as a SparseVec (bitwise identical on
every rank).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

import torch

from ..comm import Comm
from ..sparse import SparseVec

ALGORITHMS: dict[str, Callable] = {}
#: name -> ``cost(P, n, k, value_bytes=4, index_bytes=4, pattern="random") -> dict`` with keys
#: ``rounds`` and ``bytes_received`` (per rank; a number, or a ``(low, high)`` pair for a bound):
#: the document's alpha-beta formula, used by tests (ledger == formula) and the simulator.
COSTS: dict[str, Callable] = {}
_loaded = False


def register(name: str, cost: Callable | None = None):
    """Decorator: ``@register("ssar_rec_dbl", cost=f) def algo(sv, comm, **options) -> SparseVec | Tensor``."""

    def deco(fn):
        if name in ALGORITHMS and ALGORITHMS[name] is not fn:
            raise ValueError(f"sparse all-reduce algorithm {name!r} registered twice")
        ALGORITHMS[name] = fn
        if cost is not None:
            COSTS[name] = cost
        return fn

    return deco


def load_all() -> dict[str, Callable]:
    """Import every module of the package so that each registers its algorithms."""
    global _loaded
    if not _loaded:
        pkg = importlib.import_module(__package__)
        for mod in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{__package__}.{mod.name}")
        _loaded = True
    return ALGORITHMS


def sparse_allreduce(sv: SparseVec, comm: Comm, algorithm: str = "auto", check: bool = True,
                     **options) -> SparseVec:
    """Exact sum over ranks of every rank's SparseVec (lossless), identical on every rank."""
    algos = load_all()
    if algorithm not in algos:
        raise ValueError(f"unknown sparse all-reduce algorithm {algorithm!r}; valid: {', '.join(sorted(algos))}")
    if not isinstance(sv, SparseVec):
        raise TypeError(f"sparse_allreduce needs a SparseVec, got {type(sv).__name__} "
                        "(use SparseVec.from_dense for a dense tensor)")
    if check:
        comm.check_same(sv.numel, "SparseVec numel")
    with comm.phase(algorithm):
        out = algos[algorithm](sv, comm, **options)
    if isinstance(out, torch.Tensor):
        out = SparseVec.from_dense(out)
    return out
