"""Count sketch with shared seeded hashes, block bitmap and median query (S2 Reducer's "sparse-sketch").

Ge et al., "S2 Reducer: High-Performance Sparse Communication to Accelerate Distributed Deep
Learning" (2021), §3. A count sketch ``S`` is an ``r x c`` table; element ``i`` of a vector
``g`` adds ``s_j(i) * g[i]`` to cell ``S[j, h_j(i)]`` of every row ``j``. The sketch is **linear**
(``sketch(g1) + sketch(g2) == sketch(g1 + g2)`` in exact arithmetic), so summing the tables of all
ranks with one dense all-reduce gives the sketch of the summed gradient, *provided every rank uses
the same hash functions*: they are derived here from one integer ``seed``.

Query (decompression): row ``j``'s estimate of ``g[i]`` is ``s_j(i) * S[j, h_j(i)]``; the answer is
the median over rows (``r`` odd: the middle value; ``r`` even: the mean of the two middle values).
For ``r = 1`` the estimate is unbiased over the random choice of hashes
(``E[est_i] = g_i + sum_{k != i} g_k E[s(i)s(k)] P[h(i)=h(k)] = g_i``) with variance
``~ sum_{k != i} g_k^2 / c``; the median of ``r > 1`` rows is not unbiased in general
(the paper's Theorem 1 proves unbiasedness for one row) but concentrates: its error shrinks as ``c`` grows.

Hash family (our choice: the paper does not fix one; over the flat element index ``i``), with the
Mersenne prime ``p = 2^31 - 1`` so that every product fits in int64 on every device:

* bucket ``h_j(i) = ((a_j * x + b_j) mod p) mod c`` — 2-wise independent (up to the ``mod c``
  rounding), ``x = i mod p``;
* sign ``s_j(i) = 1 - 2 * (q_j(x) mod 2)`` with ``q_j`` a random degree-3 polynomial mod ``p`` —
  4-wise independent up to a ``1/p`` parity bias.

Indices ``i >= p`` alias ``i - p`` (vectors of more than 2.1e9 elements hash with collisions between
``i`` and ``i + p``; never the case in this project). Hashes are computed on the fly from the
indices (a handful of int64 passes over ``r * m`` entries, ``mod p`` by Mersenne folding), or, after
:meth:`CountSketch.precompute`, gathered from per-index tables (int32 bucket + int8 sign per row).

Bitmap (the paper's ``C``, §3): one entry per block, ``1`` where this rank has a non-zero block. After a SUM
all-reduce an entry is ``> 0`` exactly where some rank had that block: the block-level support of
the aggregate, exactly (the bitmap is summed as floats in the same buffer as the sketch; counts of
positive ones cannot round to zero in any float type).

Everything is vectorised: encoding is one ``index_add_`` into the flattened table for all rows at
once (on CUDA :func:`sparsync.sparse.add_at`'s sort-based sum instead: atomics would add colliding
cells in a different order on every call), querying one gather of ``r x m`` cells plus a median over
the row dimension.
"""

from __future__ import annotations

import math

import torch

from .sparse import add_at

__all__ = [
    "PRIME",
    "CountSketch",
    "block_bitmap",
    "block_elements",
    "blocks_from_bitmap",
    "median_rows",
    "sketch_columns",
]

#: Mersenne prime 2^31 - 1: coefficients and reduced indices are < 2^31, so ``a*x + b < 2^62``.
_PRIME_BITS = 31
PRIME = 2**_PRIME_BITS - 1
#: Largest row count whose median uses the min/max network (``r`` passes of ``r / 2`` elementwise
#: ops, ~``r^2 / 2`` in all) instead of ``torch.sort``, which is far cheaper than ``torch.median`` for small ``r``;
#: 9 is a round cap for the quadratic network, the sort serves any larger ``r``.
_NETWORK_MAX_ROWS = 9


def _check_pos_int(value, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int,)) and not (
        isinstance(value, float) and value.is_integer()
    ):
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    v = int(value)
    if v < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return v


def sketch_columns(expected_nnz: int, rows: int = 1, columns: int | None = None,
                   ratio: float | None = None) -> int:
    """Columns ``c`` of an ``r x c`` sketch (the paper's §3 sizing): ``columns`` if given, else ``ceil(ratio*nnz/r)``.

    ``ratio`` is the paper's ``lambda = m / (alpha d)`` with ``m = r*c`` the total number of cells and
    ``alpha d = expected_nnz`` the expected per-rank non-zero count. A sketch needs at least one column:
    ``columns < 1`` and ``ratio <= 0`` are errors (a positive ratio always gives ``c >= 1``).
    """
    rows = _check_pos_int(rows, "sketch rows")
    if columns is not None and ratio is not None:
        raise ValueError("give either the sketch columns or the size ratio lambda, not both")
    if columns is not None:
        return _check_pos_int(columns, "sketch columns (a sketch needs at least 1 column)")
    if ratio is None:
        ratio = 0.5
    try:
        lam = float(ratio)
    except (TypeError, ValueError):
        raise ValueError(f"sketch size ratio lambda must be a positive number, got {ratio!r}") from None
    if not lam > 0 or math.isinf(lam) or math.isnan(lam):
        raise ValueError(f"sketch size ratio lambda must be a positive number, got {ratio!r}")
    return max(1, math.ceil(lam * int(expected_nnz) / rows))


class CountSketch:
    """``rows x columns`` count sketch whose hashes are a pure function of ``seed``.

    Two instances with the same ``(rows, columns, seed)`` hash identically on every rank and device.
    The table itself is a plain ``(rows, columns)`` tensor returned by :meth:`encode`, so it can be
    flattened into a communication buffer and summed.
    """

    def __init__(self, rows: int, columns: int, seed: int = 42, device="cpu"):
        self.rows = _check_pos_int(rows, "sketch rows")
        self.columns = _check_pos_int(columns, "sketch columns (a sketch needs at least 1 column)")
        self.seed = int(seed)
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(self.seed)
        # per row: bucket (a in [1,p), b in [0,p)), sign polynomial c3..c0 (c3 in [1,p))
        a = torch.randint(1, PRIME, (self.rows, 1), generator=gen, dtype=torch.int64)
        b = torch.randint(0, PRIME, (self.rows, 1), generator=gen, dtype=torch.int64)
        c3 = torch.randint(1, PRIME, (self.rows, 1), generator=gen, dtype=torch.int64)
        c210 = torch.randint(0, PRIME, (3, self.rows, 1), generator=gen, dtype=torch.int64)
        self._a, self._b = a.to(self.device), b.to(self.device)
        self._c = [c3.to(self.device)] + [c.to(self.device) for c in c210]
        self._row_offset = (torch.arange(self.rows, dtype=torch.int64) * self.columns).view(-1, 1).to(self.device)
        self._table_n: int | None = None
        self._hb = self._hs = None

    @classmethod
    def from_tables(cls, buckets: torch.Tensor, signs: torch.Tensor, columns: int) -> "CountSketch":
        """A sketch with given hash tables ``buckets[j, i] = h_j(i)`` and ``signs[j, i] = s_j(i)``.

        For injecting known hash functions (a test checks every cell and median of a
        hand-computed sketch with them); indices ``>= buckets.shape[1]`` raise ``IndexError``.
        """
        buckets, signs = torch.as_tensor(buckets), torch.as_tensor(signs)
        if buckets.dim() != 2 or signs.shape != buckets.shape:
            raise ValueError(f"hash tables must be 2-D of equal shape, got {tuple(buckets.shape)} and "
                             f"{tuple(signs.shape)}")
        sk = cls(buckets.shape[0], columns, device=buckets.device)
        if int(buckets.min()) < 0 or int(buckets.max()) >= sk.columns or not bool((signs.abs() == 1).all()):
            raise ValueError(f"buckets must lie in [0, {sk.columns}) and signs in {{-1, +1}}")
        sk._hb, sk._hs, sk._table_n = buckets.to(torch.int32), signs.to(torch.int8), buckets.shape[1]
        return sk

    @property
    def size(self) -> int:
        """Number of cells ``rows * columns``."""
        return self.rows * self.columns

    def __repr__(self) -> str:
        return f"CountSketch(rows={self.rows}, columns={self.columns}, seed={self.seed})"

    # ------------------------------------------------------------------ hashes
    def _x(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 1:
            raise ValueError(f"sketch indices must be 1-D, got shape {tuple(idx.shape)}")
        x = idx.to(device=self.device, dtype=torch.int64)
        return _mod_p(x).view(1, -1)

    def _hash_buckets(self, idx: torch.Tensor) -> torch.Tensor:
        x = self._x(idx)
        return _mod_p(self._a * x + self._b).remainder_(self.columns)

    def _hash_signs(self, idx: torch.Tensor) -> torch.Tensor:
        x = self._x(idx)
        acc = self._c[0] * x + self._c[1]
        for c in self._c[2:]:  # Horner, degree 3: every intermediate < 2^62
            acc = _mod_p(acc).mul_(x).add_(c)
        return 1 - 2 * (_mod_p(acc) & 1)

    def precompute(self, numel: int) -> None:
        """Tabulate ``h_j(i)`` (int32) and ``s_j(i)`` (int8) for ``i < numel``: 5 bytes per index and row.

        Later calls with indices ``< numel`` gather from the tables instead of hashing (the hashes
        depend only on the index, so they are computed once per tensor shape); indices beyond raise
        ``IndexError``. Same values either way.
        """
        numel = int(numel)
        if self._table_n == numel:
            return
        self._table_n = None
        ar = torch.arange(numel, device=self.device)
        hb = self._hash_buckets(ar).to(torch.int32)
        hs = self._hash_signs(ar).to(torch.int8)
        self._hb, self._hs, self._table_n = hb, hs, numel

    def buckets(self, idx: torch.Tensor) -> torch.Tensor:
        """``(rows, m)`` int64 bucket ``h_j(i)`` in ``[0, columns)``."""
        if self._table_n is not None:
            return self._hb[:, idx.to(self.device, torch.int64)].to(torch.int64)
        return self._hash_buckets(idx)

    def signs(self, idx: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """``(rows, m)`` signs ``s_j(i)`` in ``{-1, +1}`` as ``dtype``."""
        if self._table_n is not None:
            return self._hs[:, idx.to(self.device, torch.int64)].to(dtype)
        return self._hash_signs(idx).to(dtype)

    def collisions(self, idx: torch.Tensor) -> int:
        """Number of index pairs sharing a bucket, summed over rows (0 => queries of ``idx`` are exact)."""
        idx = torch.unique(idx)
        h = self.buckets(idx) + self._row_offset
        counts = torch.bincount(h.flatten(), minlength=self.size)
        return int((counts * (counts - 1) // 2).sum())

    # ------------------------------------------------------------------ encode / query
    def encode(self, idx: torch.Tensor, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sketch of the sparse vector ``(idx, values)``: ``S[j, h_j(i)] += s_j(i) * v_i``.

        Returns a ``(rows, columns)`` table (``out`` if given, accumulated into). ``idx`` need not be
        sorted; repeated indices add up (the sketch is linear).
        """
        if values.dim() != 1 or values.numel() != idx.numel():
            raise ValueError(f"sketch encode needs 1-D values matching the {idx.numel()} indices, "
                             f"got shape {tuple(values.shape)}")
        if out is None:
            out = torch.zeros(self.rows, self.columns, dtype=values.dtype, device=self.device)
        elif tuple(out.shape) != (self.rows, self.columns):
            raise ValueError(f"sketch table must have shape {(self.rows, self.columns)}, got {tuple(out.shape)}")
        if idx.numel():
            flat = (self.buckets(idx) + self._row_offset).flatten()
            contrib = (self.signs(idx, values.dtype) * values.to(self.device).view(1, -1)).flatten()
            if out.is_cuda:  # index_add_'s atomics would add colliding cells in any order
                add_at(out.view(-1), flat, contrib)
            else:
                out.view(-1).index_add_(0, flat, contrib)
        return out

    def estimates(self, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``(rows, m)`` per-row estimates ``s_j(i) * S[j, h_j(i)]``."""
        if tuple(table.shape) != (self.rows, self.columns):
            raise ValueError(f"sketch table must have shape {(self.rows, self.columns)}, got {tuple(table.shape)}")
        flat = (self.buckets(idx) + self._row_offset)
        return self.signs(idx, table.dtype) * table.reshape(-1)[flat]

    def query(self, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Median over rows of the row estimates of ``g[idx]`` (1-D, same length as ``idx``)."""
        return median_rows(self.estimates(table, idx))


def _mod_p(y: torch.Tensor) -> torch.Tensor:
    """``y mod (2^31 - 1)`` for ``0 <= y < 2^63`` by Mersenne folding (bit ops, no division); in place."""
    y = (y & PRIME).add_(y >> _PRIME_BITS)
    y = (y & PRIME).add_(y >> _PRIME_BITS)
    return y.sub_(PRIME * (y >= PRIME))


def median_rows(est: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 of an ``(r, m)`` tensor; ``r`` even: mean of the two middle values.

    ``r <= _NETWORK_MAX_ROWS`` (9): an odd-even transposition network of elementwise min/max (``r``
    passes, vectorised over ``m``: no sort);
    larger ``r``: ``torch.sort``.
    """
    r = est.shape[0]
    if r == 1:
        return est[0]
    if r <= _NETWORK_MAX_ROWS:
        v = list(est.unbind(0))
        for p in range(r):
            for i in range(p % 2, r - 1, 2):
                lo, hi = torch.minimum(v[i], v[i + 1]), torch.maximum(v[i], v[i + 1])
                v[i], v[i + 1] = lo, hi
    else:
        v = list(est.sort(dim=0).values.unbind(0))
    h = r // 2
    return v[h] if r % 2 else (v[h - 1] + v[h]) / 2


# ---------------------------------------------------------------------- bitmap helpers
def block_bitmap(block_ids: torch.Tensor, nblocks: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """1-D bitmap of length ``nblocks``: 1 at ``block_ids`` (repeats allowed), 0 elsewhere."""
    out = torch.zeros(nblocks, dtype=dtype, device=device if device is not None else block_ids.device)
    if block_ids.numel():
        out[block_ids.to(out.device, torch.int64)] = 1
    return out


def blocks_from_bitmap(summed: torch.Tensor) -> torch.Tensor:
    """Sorted int64 ids of the blocks whose (summed) bitmap entry is ``> 0``."""
    return torch.nonzero(summed > 0, as_tuple=True)[0]


def block_elements(block_ids: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    """Flat element indices of the given blocks, ascending for sorted ids; the padding past ``numel``
    of a short last block is dropped."""
    ar = torch.arange(block_size, dtype=torch.int64, device=block_ids.device)
    idx = (block_ids.to(torch.int64).view(-1, 1) * block_size + ar).flatten()
    if block_ids.numel() and (int(block_ids.max()) + 1) * block_size > numel:
        idx = idx[idx < numel]
    return idx
