"""sparsync: sparse gradient communication for data-parallel PyTorch on bandwidth-limited networks.

Public contract::

    ss.SparseVec, ss.run_local, ss.sparse_allreduce, ss.make_reducer

Every name is imported on first use (PEP 562), so ``import sparsync`` and ``sparsync --help`` /
``--version`` do not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> submodule that defines it
_LAZY = {
    "SparseVec": "sparse", "Comm": "comm", "Ledger": "comm", "run_local": "launch", "comm_from_env": "launch",
    "torchrun_main": "launch", "sparse_allreduce": "collectives", "sparse_allreduce_dense": "collectives",
    "make_reducer": "reducers",
    "Reducer": "reducers", "SparseDDP": "ddp", "ddp_hook": "ddp", "DDPHook": "ddp", "GradientPolicy": "convergence",
    "DiLoCo": "localsteps",
    "site_layout": "sites",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'sparsync' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
