"""SparseVec and the sparse/dense stream format (SparCML: Renggli et al., SC'19).

A gradient slice travels either as *sparse* (sorted unique indices + values) or as *dense* (all
``numel`` values). SparCML's stream switches to dense as soon as the sparse form would not be
smaller on the wire; every operation that can grow a vector (summation) applies the same rule.

The switch rule (SparCML's stream format; ``>=`` on bytes, as the authors' code does)::

    go dense  iff  nnz * (index_bytes + value_bytes) >= numel * value_bytes

A *payload* in this module is either a :class:`SparseVec` or a dense 1-D ``torch.Tensor``.

One module because its parts are one format: the vector, the arithmetic that keeps the switch rule
when payloads are summed, and the wire encoding of the same rule; every collective and reducer
imports them together, and a split would only move the rule into two places.
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = [
    "SparseVec",
    "Payload",
    "IndexFlags",
    "coalesce_in_order",
    "index_dtype_for",
    "sparse_is_smaller",
    "add",
    "as_dense",
    "as_dtype",
    "sum_dtype",
    "sum_in_rank_order",
    "sum_streams",
    "encode",
    "decode",
    "decode_views",
    "wire_nbytes",
    "HEADER_BYTES",
    "add_at",
    "set_at",
]

INT32_MAX = 2**31 - 1


def add_at(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[index[j]] += values[j]`` for every ``j`` of the 1-D ``index``, in order (a repeated
    index accumulates in input order): ``out.index_add_(0, index, values)`` bit for bit, by
    ``scatter_add_``, which on one CPU thread has no per-call overhead of the size of ``out``
    (``index_add_`` has one). ``out`` is 1-D (a view of a flat buffer);
    ``values`` has ``out``'s dtype. Returns ``out``.

    On CUDA ``scatter_add_`` (and ``index_add_``) add a repeated index with atomics, in whatever
    order the threads arrive: different bits from call to call and from rank to rank. There
    ``index_put_(accumulate=True)`` runs instead, torch's sort-based kernel: a stable sort of the
    indices, then each index's values summed in input order - deterministic, and bitwise the CPU's
    result where ``out`` is zero at the repeated indices (every caller that repeats one)."""
    index = index if index.dtype == torch.int64 else index.long()
    if out.is_cuda:
        return out.index_put_((index,), values, accumulate=True)
    return out.scatter_add_(0, index, values)


def set_at(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[index] = values`` for a 1-D ``index`` without repeats (values cast to ``out``'s dtype, as
    indexing assignment does): ``index_copy_`` by ``scatter_``, about half its time and a sixth of
    ``out[index] = values`` on one CPU thread for 1e5 entries into 1e7. Returns ``out``."""
    return out.scatter_(0, index if index.dtype == torch.int64 else index.long(), values.to(out.dtype))


class SparseVec:
    """A 1-D sparse vector: strictly increasing int64 ``indices``, matching ``values``, length ``numel``.

    Validation is O(nnz) and on by default; internal code that builds vectors known to be valid
    passes ``check=False``.
    """

    __slots__ = ("indices", "values", "numel")

    def __init__(self, indices: torch.Tensor, values: torch.Tensor, numel: int, *, check: bool = True):
        if check:
            indices, values, numel = _validated(indices, values, numel)
        self.indices = indices
        self.values = values
        self.numel = int(numel)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dense(cls, t: torch.Tensor) -> "SparseVec":
        """The nonzeros of a 1-D tensor."""
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError(f"SparseVec.from_dense needs a 1-D tensor, got {_describe(t)}")
        idx = torch.nonzero(t, as_tuple=True)[0]
        return cls(idx, t.index_select(0, idx), t.numel(), check=False)

    @classmethod
    def coalesce(cls, indices: torch.Tensor, values: torch.Tensor, numel: int) -> "SparseVec":
        """Build from unsorted indices that may repeat; repeated indices are summed.

        Summation of duplicates follows the input order (stable sort), so the result is
        deterministic on CPU.
        """
        if indices.dim() != 1 or values.dim() != 1 or indices.numel() != values.numel():
            raise ValueError(
                f"coalesce needs 1-D indices and values of equal length, got {_describe(indices)} "
                f"and {_describe(values)}"
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise ValueError(f"coalesce: indices out of range [0, {numel})")
        indices = indices.to(torch.int64)
        uniq, inverse = torch.unique(indices, sorted=True, return_inverse=True)
        vals = torch.zeros(uniq.numel(), dtype=values.dtype, device=values.device)
        add_at(vals, inverse, values)
        return cls(uniq, vals, numel, check=False)

    @classmethod
    def empty(cls, numel: int, dtype=torch.float32, device=None) -> "SparseVec":
        return cls(
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dtype=dtype, device=device),
            numel,
            check=False,
        )

    # ------------------------------------------------------------------ views
    @property
    def nnz(self) -> int:
        return self.indices.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        set_at(out, self.indices, self.values)
        return out

    def to(self, device) -> "SparseVec":
        return SparseVec(self.indices.to(device), self.values.to(device), self.numel, check=False)

    def __add__(self, other):
        """Exact sum; sparse + sparse stays a SparseVec (union), sparse + dense is dense."""
        if isinstance(other, SparseVec):
            _check_same_numel(self.numel, other.numel)
            return _sparse_union(self, other)
        if isinstance(other, torch.Tensor):
            _check_same_numel(self.numel, other.numel())
            return add_at(other.clone(), self.indices, self.values.to(other.dtype))
        return NotImplemented

    __radd__ = __add__

    def __repr__(self) -> str:
        return f"SparseVec(nnz={self.nnz}, numel={self.numel}, dtype={self.dtype}, device={self.device})"

    def __eq__(self, other) -> bool:  # exact, bitwise equality of the representation
        return (
            isinstance(other, SparseVec)
            and self.numel == other.numel
            and torch.equal(self.indices, other.indices)
            and torch.equal(self.values, other.values)
        )

    __hash__ = None  # mutable tensors inside


Payload = Union[SparseVec, torch.Tensor]


# ---------------------------------------------------------------------- validation helpers
def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    return type(t).__name__


def _check_same_numel(a: int, b: int) -> None:
    if a != b:
        raise ValueError(f"numel mismatch: {a} vs {b}")


def _validated(indices, values, numel):
    if not isinstance(indices, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise TypeError("SparseVec needs tensors for indices and values")
    if indices.dim() != 1:
        raise ValueError(f"SparseVec indices must be 1-D, got {_describe(indices)}")
    if values.dim() != 1:
        raise ValueError(f"SparseVec values must be 1-D, got {_describe(values)}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.dtype.is_complex:
        raise TypeError(f"SparseVec indices must be integers, got {indices.dtype}")
    if indices.numel() != values.numel():
        raise ValueError(f"SparseVec has {indices.numel()} indices but {values.numel()} values")
    if isinstance(numel, torch.Tensor) and numel.numel() == 1 and not numel.dtype.is_floating_point:
        numel = int(numel)
    if isinstance(numel, bool) or not isinstance(numel, int):  # 2.7 must not become 2 silently
        import operator

        try:
            if isinstance(numel, bool):
                raise TypeError
            numel = operator.index(numel)
        except TypeError:
            raise TypeError(f"SparseVec numel must be an integer, got {numel!r}") from None
    if numel < 0:
        raise ValueError(f"SparseVec numel must be >= 0, got {numel}")
    indices = indices.to(torch.int64)
    if indices.numel():
        lo, hi = int(indices[0]), int(indices[-1])
        if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise ValueError("SparseVec indices must be sorted and unique (strictly increasing)")
        if lo < 0 or hi >= numel:
            raise ValueError(f"SparseVec indices out of range [0, {numel}): min {lo}, max {hi}")
    return indices, values, numel


# ---------------------------------------------------------------------- stream arithmetic
def index_dtype_for(numel: int) -> torch.dtype:
    """Indices travel as int32 when every index fits (SparCML uses 32-bit indices), else int64."""
    return torch.int32 if numel <= INT32_MAX else torch.int64


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def sparse_is_smaller(nnz: int, numel: int, value_dtype: torch.dtype = torch.float32) -> bool:
    """SparCML's switch rule: stay sparse only while ``nnz*(c+isize) < numel*isize``."""
    vb = _elem_bytes(value_dtype)
    ib = _elem_bytes(index_dtype_for(numel))
    return nnz * (ib + vb) < numel * vb


def as_dense(x: Payload) -> torch.Tensor:
    return x.to_dense() if isinstance(x, SparseVec) else x


def _sparse_union(a: SparseVec, b: SparseVec) -> SparseVec:
    """Union of two sorted sparse vectors, values summed where both have an index (``a + b``)."""
    idx = torch.cat([a.indices, b.indices])
    vals = torch.cat([a.values, b.values.to(a.values.dtype)])
    uniq, inverse = torch.unique(idx, sorted=True, return_inverse=True)
    out = torch.zeros(uniq.numel(), dtype=vals.dtype, device=vals.device)
    add_at(out, inverse, vals)  # 0 + a + b: bitwise equal to a + b, and to b + a
    return SparseVec(uniq, out, a.numel, check=False)


def add(a: Payload, b: Payload) -> Payload:
    """SparCML ``sum_into_stream`` case 1 (same index space) with the automatic switch to dense.

    * both sparse: the upper bound ``nnz_a + nnz_b`` decides (1a); dense result is O(N),
      sparse result O(nnz_a + nnz_b).
    * either dense: scatter-add the sparse one into a copy of the dense one (1c/1d), or add (1b).

    Half-precision operands are summed in fp32 (:func:`sum_dtype`). Never modifies its inputs.
    ``add(a, b)`` and ``add(b, a)`` are bitwise identical.
    """
    na = a.numel if isinstance(a, SparseVec) else a.numel()
    nb = b.numel if isinstance(b, SparseVec) else b.numel()
    _check_same_numel(na, nb)
    dt = sum_dtype(torch.promote_types(a.dtype, b.dtype))
    a, b = as_dtype(a, dt), as_dtype(b, dt)
    if isinstance(a, SparseVec) and isinstance(b, SparseVec):
        if sparse_is_smaller(a.nnz + b.nnz, na, a.dtype):
            return _sparse_union(a, b)
        out = torch.zeros(na, dtype=a.dtype, device=a.device)
        set_at(out, a.indices, a.values)
        return add_at(out, b.indices, b.values)
    if isinstance(a, SparseVec):
        return add_at(b.clone(), a.indices, a.values)
    if isinstance(b, SparseVec):
        return add_at(a.clone(), b.indices, b.values)
    return a + b


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are computed in: at least float32 (fp16/bf16 values that travel in half
    precision are summed in fp32, so no mass is lost in the sum), else ``dtype``."""
    return torch.promote_types(dtype, torch.float32)


def as_dtype(x: Payload, dtype: torch.dtype) -> Payload:
    if x.dtype == dtype:
        return x
    if isinstance(x, SparseVec):
        return SparseVec(x.indices, x.values.to(dtype), x.numel, check=False)
    return x.to(dtype)


def sum_in_rank_order(payloads, numel: int, dtype, device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense sum of decoded payloads (SparseVec or dense tensors) in rank order: deterministic, so
    the same bits on every rank; values of any float dtype are summed in ``dtype``. ``out``: a
    zero-filled buffer of ``numel`` elements to sum into (a reducer's recycled output), else a new one."""
    if out is None:
        out = torch.zeros(int(numel), dtype=dtype, device=device)
    for p in payloads:
        if isinstance(p, SparseVec):
            add_at(out, p.indices, p.values.to(dtype))
        else:
            out += p
    return out


def sum_streams(parts: list, numel: int, dtype: torch.dtype | None = None, device=None) -> Payload:
    """Exact sum of several payloads of one index space, in list order, in one pass.

    The multi-operand form of :func:`add` (a part owner summing what ``P`` ranks sent, an
    all-gather summing every rank's stream): instead of ``P - 1`` pairwise unions (one sort each)
    it concatenates the sparse parts and sorts once (``torch.unique``), then scatter-adds the
    values in list order, so every index gets ``0 + v_0 + v_1 + ...`` - bitwise the same as the
    chain of pairwise :func:`add` calls, and the same on every rank that sums the same list.

    Representation of the result (mirrored by the cost formulas, ``CostSim.add_many``):

    * dense when any part is dense, or when the parts hold ``>= numel`` items together (one dense
      scatter-add pass is then cheaper than sorting them);
    * otherwise sparse when the *actual* union ``u`` is smaller on the wire
      (``u*(c+isize) < numel*isize``, SparCML's switch rule), else dense.
    """
    numel = int(numel)
    if not parts:
        raise ValueError("sum_streams needs at least one part")
    dtype = dtype or parts[0].dtype
    device = device if device is not None else parts[0].device
    sparse = [p for p in parts if isinstance(p, SparseVec)]
    if len(sparse) < len(parts) or sum(p.nnz for p in sparse) >= numel:
        return sum_in_rank_order(parts, numel, dtype, device)
    uniq, out = coalesce_in_order([p.indices for p in sparse], [p.values.to(dtype) for p in sparse], numel)
    if sparse_is_smaller(uniq.numel(), numel, dtype):
        return SparseVec(uniq, out, numel, check=False)
    dense = torch.zeros(numel, dtype=dtype, device=device)
    set_at(dense, uniq, out)
    return dense


def coalesce_in_order(idx_parts, val_parts, numel: int | None = None):
    """Sorted unique indices of the concatenated parts and their values summed in part order.

    One *stable* sort of the indices (as int32 when ``numel`` fits: half the bytes to move of
    ``torch.unique``'s int64 sort), so equal indices stay
    in part order, then a segment sum by :func:`add_at` over the non-decreasing run ids: every index
    gets ``0 + v_0 + v_1 + ...`` in part order, bitwise the same on every rank. ``numel``: an
    upper bound of the indices (None: any int64).
    """
    idx = torch.cat(idx_parts) if len(idx_parts) > 1 else idx_parts[0]
    vals = torch.cat(val_parts) if len(val_parts) > 1 else val_parts[0]
    key = idx.to(torch.int32) if numel is not None and numel <= INT32_MAX else idx
    s, perm = torch.sort(key, stable=True)
    new = torch.ones(s.numel(), dtype=torch.bool, device=s.device)
    torch.ne(s[1:], s[:-1], out=new[1:])
    run = torch.cumsum(new, 0).sub_(1)
    uniq = s[new].to(torch.int64)
    out = add_at(torch.zeros(uniq.numel(), dtype=vals.dtype, device=vals.device), run, vals.index_select(0, perm))
    return uniq, out


class IndexFlags:
    """``torch.isin(idx, members)`` for indices in ``[0, numel)`` in O(len(idx) + len(members)).

    A persistent all-False bool vector of ``numel`` flags: the members' flags are set, ``idx``'s
    are read, the members' are cleared again - three sparse passes instead of ``isin``'s sort of
    both lists, and no pass over ``numel`` after
    the first call (the vector is allocated once, zero-filled, and kept by the caller).
    The flags are bytes written by ``index_fill_`` and read by ``index_select``, which on CPU are
    cheaper than advanced indexing (``f[members] = True``, ``f[idx]``) on bool flags.
    """

    def __init__(self):
        self._flags: torch.Tensor | None = None

    def isin(self, idx: torch.Tensor, members: torch.Tensor, numel: int) -> torch.Tensor:
        """Bool mask over ``idx``: True where the index is one of ``members``."""
        f = self._flags
        if f is None or f.numel() != numel or f.device != members.device:
            f = self._flags = torch.zeros(int(numel), dtype=torch.uint8, device=members.device)
        members = members.to(torch.int64)
        f.index_fill_(0, members, 1)
        hit = f.index_select(0, idx.to(torch.int64)).view(torch.bool)
        f.index_fill_(0, members, 0)
        return hit


# ---------------------------------------------------------------------- wire format
HEADER_BYTES = 8  # one int64 item count; 8 bytes keeps int64 indices / float64 values aligned


def wire_nbytes(nnz: int, numel: int, value_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of :func:`encode`'s buffer: header + min(sparse, dense) payload (dense at equality)."""
    vb = _elem_bytes(value_dtype)
    if sparse_is_smaller(nnz, numel, value_dtype):
        return HEADER_BYTES + nnz * (_elem_bytes(index_dtype_for(numel)) + vb)
    return HEADER_BYTES + numel * vb


def encode(x: Payload, numel: int | None = None) -> torch.Tensor:
    """Pack a payload into one uint8 buffer: ``[count:int64][indices][values]`` or ``[numel][dense]``.

    The count equals ``numel`` exactly when the payload is dense (SparCML's dense marker; a sparse
    stream always has fewer items than ``numel`` because it would otherwise have switched).
    Indices are stored as int32 when ``numel`` fits (:func:`index_dtype_for`). Layout is struct of
    arrays (all indices, then all values) so both halves are single contiguous copies in torch.
    """
    if isinstance(x, SparseVec):
        numel = x.numel
        if not sparse_is_smaller(x.nnz, numel, x.dtype):
            return encode(x.to_dense())
        header = torch.tensor([x.nnz], dtype=torch.int64, device=x.device)
        idx = x.indices.to(index_dtype_for(numel))
        parts = [header.view(torch.uint8), idx.view(torch.uint8), x.values.contiguous().view(torch.uint8)]
        return torch.cat(parts)
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        raise ValueError(f"encode needs a SparseVec or a 1-D tensor, got {_describe(x)}")
    header = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    return torch.cat([header.view(torch.uint8), x.contiguous().view(torch.uint8)])


def _slice_as(buf: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    nbytes = count * _elem_bytes(dtype)
    piece = buf[start : start + nbytes]
    if piece.storage_offset() % _elem_bytes(dtype):
        piece = piece.clone()
    return piece.view(dtype)


def decode(buf: torch.Tensor, numel: int, value_dtype: torch.dtype = torch.float32) -> Payload:
    """Inverse of :func:`encode`: a SparseVec, or a dense tensor when the dense marker is set."""
    idx, vals = decode_views(buf, numel, value_dtype)
    if idx is None:
        return vals.clone()
    return SparseVec(idx.to(torch.int64), vals.clone(), numel, check=False)


def decode_views(buf: torch.Tensor, numel: int, value_dtype: torch.dtype = torch.float32):
    """:func:`decode` without copies: ``(indices, values)`` as views of ``buf`` - the indices in the
    wire's index dtype (int32 when ``numel`` fits) - or ``(None, dense values)`` for a dense
    stream. For a caller that consumes the stream at once (a scatter into a dense sum) while
    ``buf`` is alive; a view that is not aligned for its dtype is copied."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < HEADER_BYTES:
        raise ValueError(f"decode needs a 1-D uint8 buffer of at least {HEADER_BYTES} bytes")
    count = int(_slice_as(buf, 0, 1, torch.int64)[0])
    vb = _elem_bytes(value_dtype)
    if count == numel:
        if buf.numel() != HEADER_BYTES + numel * vb:
            raise ValueError(f"dense stream of {numel} values has {buf.numel()} bytes")
        return None, _slice_as(buf, HEADER_BYTES, numel, value_dtype)
    if count < 0 or count > numel:
        raise ValueError(f"stream count {count} is outside [0, {numel}]")
    itype = index_dtype_for(numel)
    ib = _elem_bytes(itype)
    if buf.numel() != HEADER_BYTES + count * (ib + vb):
        raise ValueError(f"sparse stream of {count} items has {buf.numel()} bytes")
    return _slice_as(buf, HEADER_BYTES, count, itype), _slice_as(buf, HEADER_BYTES + count * ib, count, value_dtype)
