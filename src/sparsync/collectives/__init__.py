"""Lossless sparse all-reduce algorithms (``ss.sparse_allreduce``).

Every module in this package registers its algorithms with :func:`register`; the package imports
all of its modules on first use, so adding an algorithm means adding one file.
"""

from .registry import ALGORITHMS, COSTS, load_all, register, sparse_allreduce, sparse_allreduce_dense

__all__ = ["ALGORITHMS", "COSTS", "load_all", "register", "sparse_allreduce", "sparse_allreduce_dense"]
