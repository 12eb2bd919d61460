"""The arithmetic of the SparCML cost formulas: stream sizes, expected unions, the dense switch.

SparCML: Renggli, Ashkboos, Aghagolzadeh, Alistarh, Hoefler, "SparCML: High-Performance Sparse
Communication for Machine Learning" (SC'19); its long form is Renggli's thesis "Efficient Sparse
AllReduce for Scalable Machine Learning" (ETH Zurich, 2017), whose sections the ``§`` numbers cite.
Every cost formula of the family is written in the bytes of encoded streams (:func:`stream_bytes`:
an 8-byte item count, then indices and values, or the dense values when the sparse form would not
be smaller). :class:`CostSim` follows the sizes of the streams an algorithm sends and the local work
on the critical path; :func:`expected_union` is the expected number of distinct indices of ``P``
uniform ``k``-subsets; :func:`cost_setup` is the common start of a formula on ``P' = 2^floor(log2 P)``
ranks (the fold/unfold of a world size that is not a power of two adds two rounds). The data path
of the family is :mod:`sparsync.collectives.sparcml_common`, which re-exports these names.
"""

from __future__ import annotations

import math

import torch

from ..sparse import index_dtype_for

__all__ = ["CostSim", "cost_setup", "expected_union", "index_bytes_for", "log2i", "num", "pow2_floor",
           "stream_bytes", "union_model"]


def pow2_floor(P: int) -> int:
    """Largest power of two ``<= P``."""
    return 1 << (int(P).bit_length() - 1)


def stream_bytes(m: int, d: int, value_bytes: int = 4, index_bytes: int = 4, header: int = 8) -> int:
    """Bytes of an encoded stream of ``m`` items in dimension ``d`` (dense when not smaller)."""
    if m * (index_bytes + value_bytes) < d * value_bytes:
        return header + m * (index_bytes + value_bytes)
    return header + d * value_bytes


def expected_union(k: float, N: float, P: int) -> float:
    """``f(k, N, P) = N (1 - (1 - k/N)^P)``: expected union of ``P`` uniform ``k``-subsets (§3.2)."""
    if N <= 0:
        return 0.0
    return N * (1.0 - (1.0 - min(1.0, k / N)) ** P)


def cost_setup(P: int, n: int, value_bytes: int, index_bytes: int | None):
    """Common start of the SparCML cost formulas: ``(P', log2 P', fold rounds, CostSim)``.

    ``P'`` is the power of two the algorithm runs on (the fold/unfold adds 2 rounds when ``P' != P``).
    """
    if index_bytes is None:
        index_bytes = index_bytes_for(n)
    Pp = pow2_floor(P)
    return Pp, log2i(Pp), (2 if Pp != P else 0), CostSim(value_bytes, index_bytes)


def union_model(pattern: str, k_part: float, dim: int):
    """Union size ``u(j)`` after summing ``j`` parts of ``k_part`` items in a space of ``dim``.

    ``identical``: stays ``k_part``; ``expected``: uniform random indices, :func:`expected_union`;
    otherwise (``disjoint``, and the upper bound of ``random``): ``min(dim, j * k_part)``.
    """
    if pattern == "identical":
        return lambda j: k_part
    if pattern == "expected":
        return lambda j: round(expected_union(k_part, dim, j))
    return lambda j: min(dim, j * k_part)


class CostSim:
    """Stream sizes in the cost formulas, including the dense switch of the wire format.

    A stream is modelled as ``(items, dense)``; ``add`` applies the upper-bound rule of §4.1.3 case 1a
    (dense iff ``(m1 + m2)(c + isize) >= d*isize``), ``union`` is the resulting item count when it
    stays sparse. It also counts the local work on this rank's critical path: ``sparse_items``
    (items through a sparse merge, a sort-based union) and ``dense_elems`` (elements written by a
    dense operation: densify, scatter, dense add, concatenation copies); ``auto`` prices them with
    measured per-item costs.
    """

    def __init__(self, value_bytes=4, index_bytes=4):
        self.v, self.c = value_bytes, index_bytes
        self.reset()

    def reset(self):
        self.sparse_items = 0
        self.dense_elems = 0

    def work(self) -> dict:
        return {"sparse_items": num(self.sparse_items), "dense_elems": num(self.dense_elems)}

    def smaller(self, m, d) -> bool:
        return m * (self.c + self.v) < d * self.v

    def start(self, m, d):
        return (m, False) if self.smaller(m, d) else (d, True)

    def add_many(self, states, union, d):
        """:func:`~sparsync.sparse.sum_streams` of several streams whose union has ``union`` items."""
        sparse_m = sum(m for m, dense in states if not dense)
        if any(dense for _, dense in states) or sparse_m >= d:
            self.dense_elems += d + sparse_m
            return (d, True)
        self.sparse_items += sparse_m
        if self.smaller(union, d):
            return (union, False)
        self.dense_elems += d
        return (d, True)

    def add(self, a, b, union, d):
        (ma, da), (mb, db) = a, b
        if da or db or not self.smaller(ma + mb, d):
            self.dense_elems += d + (0 if da else ma) + (0 if db else mb)
            return (d, True)
        self.sparse_items += ma + mb
        return (union, False)

    def bytes(self, s, d) -> int:
        m, dense = s
        return 8 + (d * self.v if dense else m * (self.c + self.v))

    def concat(self, a, b, d):
        (ma, da), (mb, db) = a, b
        if da or db or not self.smaller(ma + mb, d):
            self.dense_elems += d
            return (d, True)
        self.dense_elems += ma + mb
        return (ma + mb, False)

    def densify(self, d):
        self.dense_elems += d


def log2i(P: int) -> int:
    return int(math.log2(P)) if P >= 1 else 0


def index_bytes_for(numel: int) -> int:
    return torch.empty(0, dtype=index_dtype_for(numel)).element_size()


def num(x):
    """An int when ``x`` is integral (formulas use ``k/P`` items per part, which may be fractional)."""
    if isinstance(x, tuple):
        return tuple(num(v) for v in x)
    return int(x) if float(x).is_integer() else x
