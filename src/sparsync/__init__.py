"""sparsync: sparse gradient communication for data-parallel PyTorch on bandwidth-limited networks.

Public contract (``DESIGN.md``)::

    ss.SparseVec, ss.run_local, ss.sparse_allreduce, ss.make_reducer
"""

from .collectives import sparse_allreduce
from .comm import Comm, Ledger
from .launch import comm_from_env, run_local, torchrun_main
from .reducers import Reducer, make_reducer
from .sparse import SparseVec

__version__ = "0.1.0"

__all__ = ["SparseVec", "Comm", "Ledger", "run_local", "comm_from_env", "torchrun_main",
           "sparse_allreduce", "make_reducer", "Reducer", "__version__"]


def __getattr__(name):  # later layers, imported lazily so `import sparsync` stays light
    if name in ("SparseDDP", "ddp_hook"):
        from . import ddp

        return getattr(ddp, name)
    if name == "GradientPolicy":
        from .convergence import GradientPolicy

        return GradientPolicy
    raise AttributeError(f"module 'sparsync' has no attribute {name!r}")
