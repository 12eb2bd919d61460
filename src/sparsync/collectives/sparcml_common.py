"""Shared pieces of the SparCML sparse all-reduce family.

SparCML: Renggli, Ashkboos, Aghagolzadeh, Alistarh, Hoefler, "SparCML: High-Performance Sparse
Communication for Machine Learning" (SC'19); its long form is Renggli's thesis "Efficient Sparse
AllReduce for Scalable Machine Learning" (ETH Zurich, 2017), whose sections the ``§`` numbers in
:mod:`sparsync.collectives` cite.

* **Streams**: a payload (:class:`~sparsync.sparse.SparseVec` or dense 1-D tensor) travels encoded
  by :func:`sparsync.sparse.encode` (8-byte item count, int32 indices, values; dense when the sparse
  form would not be smaller). ``stream_bytes(m, d)`` is the size of that buffer for ``m`` items in
  dimension ``d``; every cost formula of the family is written in these **bytes** (payload bytes as
  the ledger records them; the comm layer's own 8-byte size headers are recorded separately as
  ``header_bytes`` and are *not* part of the formulas).
* **Fold/unfold** for a world size that is not a power of two (MPICH style; the thesis assumes a power of two): with
  ``P' = 2^floor(log2 P)`` and ``e = P - P'``, ranks ``< 2e`` pair up, the odd one sends its stream to
  the even one (one round), which sums; the ``P'`` survivors run the algorithm under a *virtual rank*
  (``r/2`` for the even ranks ``< 2e``, ``r - e`` for the rest); afterwards each even rank ``< 2e``
  sends the result back to its odd partner (one round).
* **Index-range split** (§3.3.3): ``w = floor(N/P)``, part ``j = [j*w, (j+1)*w)``, last part takes the
  remainder; ``split_stream`` cuts a payload into those parts, re-based to the part (dimension = part
  size), in one vectorised ``searchsorted``.
* **Case-2 concatenation** (§4.1.3): adjacent subspaces, lower first; both sparse -> sparse (switched to
  dense if the combined sparse form is not smaller), anything dense -> dense.
* **Canonical summation**: all summations of more than two operands happen on exactly one rank (the
  owner of a part) in a fixed order, and two-operand sums are commutative bitwise, so every rank
  ends with a bitwise identical result.
"""

from __future__ import annotations

import torch

from ..recycle import recycled
from ..sparse import (SparseVec, as_dtype, add, decode, encode, sparse_is_smaller, sum_dtype,
                      wire_nbytes,
                      set_at, sum_streams)
from .sparcml_cost import (CostSim, cost_setup, expected_union, index_bytes_for, log2i, num, pow2_floor,
                           stream_bytes, union_model)

__all__ = [
    # the cost arithmetic (.sparcml_cost), re-exported: the collectives import it from here
    "cost_setup", "index_bytes_for", "log2i", "num", "union_model",
    "CostSim",
    "Fold",
    "allgather_concat",
    "as_stream",
    "concat",
    "densify",
    "direct_split_sum",
    "exchange_stream",
    "expected_union",
    "fold",
    "padded_bounds",
    "part_bounds",
    "pow2_floor",
    "send_stream",
    "split_stream",
    "stream_bytes",
    "block_bytes",
    "stream_count",
    "unfold",
    "write_block",
]


# ---------------------------------------------------------------------- small helpers
def as_stream(sv: SparseVec):
    """The input stream: dense directly when ``k`` items would not be smaller than dense (§4.1.2)."""
    if sparse_is_smaller(sv.nnz, sv.numel, sv.dtype):
        return sv
    return sv.to_dense()


def numel_of(x) -> int:
    return x.numel if isinstance(x, SparseVec) else x.numel()


def exchange_stream(comm, x, partner: int, numel: int, dtype) -> object:
    """Send payload ``x`` to ``partner`` and receive its payload (variable size, one round) of
    values of ``dtype`` (partners in the same stage hold payloads of the same dtype)."""
    buf = comm.sendrecv(encode(x), partner, partner)
    return decode(buf, numel, dtype)


def send_stream(comm, x, dst: int) -> None:
    comm.send(encode(x), dst)


def recv_stream(comm, src: int, numel: int, dtype):
    return decode(comm.recv(src, dtype=torch.uint8), numel, dtype)


# ---------------------------------------------------------------------- fold / unfold
class Fold:
    """Where this rank stands after folding ``P`` ranks into ``P' = 2^floor(log2 P)``.

    ``vrank`` is this rank's virtual rank among the survivors (None for a folded-away odd rank);
    ``real(v)`` maps a virtual rank back to a real one.
    """

    def __init__(self, rank: int, P: int):
        self.P = P
        self.Pp = pow2_floor(P)
        self.e = P - self.Pp
        if rank < 2 * self.e:
            self.vrank = rank // 2 if rank % 2 == 0 else None
        else:
            self.vrank = rank - self.e
        self.rank = rank

    def real(self, v: int) -> int:
        return 2 * v if v < self.e else v + self.e

    @property
    def active(self) -> bool:
        return self.vrank is not None


def fold(comm, x, numel: int, dtype) -> tuple[Fold, object]:
    """Pre-step for non-power-of-two ``P``: odd ranks ``< 2e`` hand their stream to ``rank - 1``."""
    f = Fold(comm.rank, comm.world_size)
    if f.e == 0 or comm.rank >= 2 * f.e:
        return f, x
    with comm.phase(phase_label(comm, "fold")):
        if comm.rank % 2 == 1:
            send_stream(comm, x, comm.rank - 1)
            return f, None
        got = recv_stream(comm, comm.rank + 1, numel, dtype)
        return f, add(x, got)


def fold_active(comm, x, numel: int, dtype) -> tuple[Fold, object]:
    """:func:`fold`, and on a folded world every survivor's stream in the sum dtype: the paired
    ranks now hold a sum (fp32 for half-precision values), and every stage of the algorithms
    expects its partner's stream in its own dtype."""
    f, x = fold(comm, x, numel, dtype)
    if f.e and f.active:
        x = as_dtype(x, sum_dtype(dtype))
    return f, x


def unfold(comm, f: Fold, result, numel: int, dtype):
    """Post-step: even ranks ``< 2e`` send the result back to their odd partner."""
    if f.e == 0 or comm.rank >= 2 * f.e:
        return result
    with comm.phase(phase_label(comm, "unfold")):
        if comm.rank % 2 == 0:
            send_stream(comm, result, comm.rank + 1)
            return result
        return recv_stream(comm, comm.rank - 1, numel, sum_dtype(dtype))


def run_folded(sv: SparseVec, comm, body):
    """``body(x, f) -> payload`` on the power-of-two survivors, wrapped in fold/unfold.

    ``x`` is ``sv`` as a stream (dense if that is smaller); one rank returns it unchanged.
    """
    x = as_stream(sv)
    if comm.world_size == 1:
        return x
    f, x = fold_active(comm, x, sv.numel, sv.dtype)
    if f.active:
        x = body(x, f)
    return unfold(comm, f, x, sv.numel, sv.dtype)


def phase_label(comm, name: str) -> str:
    """``name`` nested under the current ledger phase (e.g. ``ssar_split_allgather/allgather``)."""
    lab = comm.ledger.label
    return f"{lab}/{name}" if lab and lab != "default" else name


# ---------------------------------------------------------------------- splitting
def part_bounds(numel: int, parts: int, start: int = 0) -> list[int]:
    """``parts + 1`` boundaries of ``[start, start+numel)``: width ``floor(numel/parts)``, last takes the rest."""
    w = numel // parts
    b = [start + j * w for j in range(parts)]
    b.append(start + numel)
    return b


def padded_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries of width ``m = ceil(numel/parts)`` (the last parts may be shorter or
    empty): the layout of a ring all-gather of pieces padded to ``m``, so that the gathered buffer
    *is* the result (``out[:numel]``, no reassembly copy; DSAR's dense all-gather)."""
    m = -(-numel // parts) if parts else 0
    return [min(numel, j * m) for j in range(parts)] + [numel]


def split_stream(x, bounds: list[int]) -> list:
    """Cut a payload into the index ranges ``[bounds[j], bounds[j+1])``, each re-based to its range."""
    out = []
    if isinstance(x, SparseVec):
        cuts = torch.searchsorted(x.indices, torch.tensor(bounds, dtype=torch.int64, device=x.device)).tolist()
        for j in range(len(bounds) - 1):
            lo, hi = cuts[j], cuts[j + 1]
            out.append(SparseVec(x.indices[lo:hi] - bounds[j], x.values[lo:hi], bounds[j + 1] - bounds[j],
                                 check=False))
    else:
        for j in range(len(bounds) - 1):
            out.append(x[bounds[j]:bounds[j + 1]])
    return out


def concat(lower, upper):
    """SparCML ``sum_into_stream`` case 2: adjacent subspaces, ``lower`` first (§4.1.3, cases 2a-2d)."""
    d1, d2 = numel_of(lower), numel_of(upper)
    if (isinstance(lower, SparseVec) and isinstance(upper, SparseVec)
            and sparse_is_smaller(lower.nnz + upper.nnz, d1 + d2, lower.dtype)):
        return SparseVec(torch.cat([lower.indices, upper.indices + d1]),
                         torch.cat([lower.values, upper.values]), d1 + d2, check=False)
    return torch.cat([densify(lower), densify(upper)])


def densify(x) -> torch.Tensor:
    return x.to_dense() if isinstance(x, SparseVec) else x


# ---------------------------------------------------------------------- the two phases
def direct_split_sum(comm, x, bounds: list[int], peers: list[int], me: int, dtype, while_waiting=None):
    """Split phase (§3.3.3/§4.1.4): sub-stream ``j`` goes to ``peers[j]``; sum what arrives for part ``me``.

    Counts first (the comm's size headers, recorded as header traffic), then all payloads posted
    at once (non-blocking); arrivals are decoded in a fixed order (``me-1, me-2, ...``) while the
    later ones are still in flight, then summed in one pass (:func:`~sparsync.sparse.sum_streams`:
    one sort for all ``G`` parts instead of ``G-1`` pairwise unions; result sparse or dense by the
    actual union size). ``while_waiting()``: local work run once the payloads are posted, while
    they travel (zeroing a dense result buffer). Returns the summed part ``me``.
    """
    G = len(peers)
    parts = split_stream(x, bounds)
    if G == 1:
        if while_waiting is not None:
            while_waiting()
        return parts[me]
    order = [(me - i) % G for i in range(1, G)]            # receive from these group positions
    send_order = [(me + i) % G for i in range(1, G)]       # staggered destinations
    bufs = {j: encode(parts[j]) for j in send_order}
    sends = [(peers[j], bufs[j]) for j in send_order]
    sizes = comm.exchange_sizes(sends, [peers[j] for j in order])
    handles = comm.post(sends, [(peers[j], sizes[peers[j]], torch.uint8) for j in order])
    if while_waiting is not None:
        while_waiting()
    dim = bounds[me + 1] - bounds[me]
    # every peer is in this rank's state (input dtype, or the sum dtype after a fold): decode as x
    got = [decode(h.wait(), dim, x.dtype) for h in handles]  # decoded while later ones are in flight
    return sum_streams([parts[me]] + got, dim, sum_dtype(dtype), x.device)


def allgather_concat(comm, mine, bounds: list[int], pos: int, rank_of, dtype, dense: bool = False, sink=None,
                     counts: list[int] | None = None):
    """Recursive-doubling all-gather by concatenation over ``len(bounds)-1`` (a power of two) parts.

    This rank holds part ``pos`` (re-based payload of dimension ``bounds[pos+1]-bounds[pos]``);
    ``rank_of(p)`` is the real rank holding part ``p``. At step ``t`` the partner holds the
    neighbouring block of ``2^t`` parts; the lower block goes first. ``dense=True``: every block is
    a dense tensor of known size, sent without headers (DSAR's dense all-gather).
    Returns the payload covering ``[bounds[0], bounds[-1])``.

    Sparse streams travel with a size header per step, unless ``counts`` gives every part's stream
    count (:func:`stream_count`, gathered once by the caller): then every block's size follows from
    them (:func:`block_bytes`) and no step waits for a header. ``sink(payload, offset)``: every block
    is handed to it once - this rank's part, then each received block, each while the next exchange
    is in flight - with ``offset``, its first index (a dense result written block by block while the
    wire is busy); then the full concatenation is never built and None is returned.
    """
    Q = len(bounds) - 1
    buf = mine
    pending = (mine, bounds[pos]) if sink is not None else None
    t = 1
    while t < Q:
        ppos = pos ^ t
        lo_me = pos & ~(t - 1)
        lo_p = ppos & ~(t - 1)
        partner = rank_of(ppos)
        n_p = bounds[lo_p + t] - bounds[lo_p]
        if dense:
            got = comm.sendrecv(buf, partner, partner, recv_numel=n_p, recv_dtype=dtype)
        else:  # the messages of exchange_stream, or of known size; the previous block is written meanwhile
            enc = encode(buf)
            if counts is None:
                size = comm.exchange_sizes([(partner, enc)], [partner])[partner]
            else:
                size = block_bytes(counts, bounds, lo_p, t, dtype)
            handle = comm.post([(partner, enc)], [(partner, size, torch.uint8)])[0]
            if sink is not None:
                sink(*pending)
            got = decode(handle.wait(), n_p, dtype)
            pending = (got, bounds[lo_p])
        t *= 2
        if sink is None or t < Q:
            buf = concat(buf, got) if lo_me < lo_p else concat(got, buf)
    if sink is not None:
        sink(*pending)
        return None
    return buf


def stream_count(x) -> int:
    """The item count a payload's stream header carries: ``nnz``, or ``numel`` for a dense one."""
    return x.nnz if isinstance(x, SparseVec) else x.numel()


def block_bytes(counts: list[int], bounds: list[int], lo: int, width: int, dtype) -> int:
    """Bytes of the encoded block of parts ``[lo, lo+width)`` as :func:`allgather_concat` builds it
    from parts whose streams carry ``counts`` (:func:`concat`'s rule, lower half first)."""

    def block(lo, width):  # (items, dimension, dense)
        if width == 1:
            d = bounds[lo + 1] - bounds[lo]
            return counts[lo], d, counts[lo] == d  # the stream header's dense marker
        m1, d1, dense1 = block(lo, width // 2)
        m2, d2, dense2 = block(lo + width // 2, width // 2)
        if not (dense1 or dense2) and sparse_is_smaller(m1 + m2, d1 + d2, dtype):
            return m1 + m2, d1 + d2, False
        return d1 + d2, d1 + d2, True

    m, d, _ = block(lo, width)
    return wire_nbytes(m, d, dtype)


def write_block(out: torch.Tensor, x, offset: int) -> None:
    """Write payload ``x`` (a re-based part) into the dense ``out`` at ``[offset, offset + numel(x))``:
    its items by :func:`~sparsync.sparse.set_at` (``out`` is zero there), or its dense values."""
    view = out.narrow(0, offset, numel_of(x))
    if isinstance(x, SparseVec):
        set_at(view, x.indices, x.values)
    else:
        view.copy_(x)


def ring_allgather_dense(comm, f: Fold, mine, bounds: list[int], pos_of_vrank, dtype, device):
    """Dense all-gather of the ``P'`` owned pieces with the comm's (gloo ring) all-gather.

    All ``P`` ranks take part, so the ranks folded away by :func:`fold` receive the result here
    and need no unfold. Every rank contributes ``m = max piece size`` values (the active ranks their
    piece ``pos_of_vrank(vrank)`` - a payload, sparse or dense, written straight into the send
    buffer - padded with zeros, the folded ranks zeros) into one flat buffer
    (:meth:`~sparsync.comm.Comm.allgather_into`). When the pieces are in rank order and of width
    ``m`` (no fold, identity placement, :func:`padded_bounds`) that buffer is the result; otherwise
    the pieces are put together in piece order (one copy). Ledger (ring): ``P-1`` rounds,
    ``(P-1)*m*isize`` bytes received.

    Both buffers are recycled across calls (:func:`sparsync.recycle.recycled`, a pool kept on the
    comm): no fresh ``N``-element allocation and its page faults per call; a result the caller
    still holds is never reused.
    """
    sizes = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
    m = max(sizes)
    pool = comm.__dict__.setdefault("_dense_allgather_pool", [])  # [send buffer, results ...]
    buf = recycled(pool, m, dtype, device, zero=True, keep=4)
    if f.active:
        if isinstance(mine, SparseVec):
            set_at(buf, mine.indices, mine.values)
        else:
            buf[: mine.numel()] = mine
    out = recycled(pool, comm.world_size * m, dtype, device, keep=4)  # fully written by the all-gather
    comm.allgather_into(buf, out)
    if f.e == 0 and all(pos_of_vrank(v) == v for v in range(f.Pp)) and all(s == m for s in sizes[:-1]):
        return out[: bounds[-1] - bounds[0]]
    pieces = [None] * len(sizes)
    for v in range(f.Pp):
        pos = pos_of_vrank(v)
        r = f.real(v)
        pieces[pos] = out[r * m: r * m + sizes[pos]]
    return torch.cat(pieces)
