"""Block-sparse reducers: the S2 Reducer paper's baselines (their base, shared with ``s2``, is :mod:`.blockbase`).

Ge et al., "S2 Reducer: High-Performance Sparse Communication to Accelerate Distributed Deep
Learning", 2022, §2 and its baselines (AllGather, OmniReduce). All three block reducers
(``s2``, ``blocksparse``, ``block_allgather``) transmit the *same* selection, so their communication
can be compared one to one:

* **dense gradients** (``reduce``): block-wise top-K by block L2 norm
  (:mod:`sparsync.select.blocks`) with local error feedback: ``acc = grad + residual``, the ``K``
  blocks of largest norm travel, ``residual = acc`` with those blocks zeroed (an implementation
  choice). ``K = round(density * b)``, ``b = ceil(n / block_size)``; a short last block is zero padded
  (see :mod:`sparsync.select.blocks`).
* **naturally sparse gradients** (``reduce_sparse``): the torch sparse COO gradient of
  ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``. Blocks are the table's rows, the
  block size its embedding dimension. Such gradients arrive **uncoalesced** (one entry per looked-up
  token, repeated rows); they are coalesced here (duplicates summed) before anything else, so callers
  need not. No error feedback on this path (as the S2 paper: embedding gradients are communicated without
  error feedback): every touched row travels. Returns the dense SUM over ranks with the gradient's
  shape. A fully sparse 2-D COO tensor (``sparse_dim == 2``) is accepted too (its rows become dense
  blocks). ``reduce_sparse`` does not advance ``step``; its figures go to ``stats`` (like ``reduce``:
  the last call's) and stay in ``sparse_stats`` after a later dense ``reduce``.

Reducers here (both lossless on what was selected, hence ``conserving = True`` on the dense path):

``blocksparse`` — OmniReduce-style: only non-zero blocks travel. Step 1: all-reduce (MAX) of a
``uint8`` bitmap with one entry per block → the union ``U`` of the ranks' blocks, the same on every
rank. Step 2: dense SUM all-reduce of a ``|U| x block_size`` buffer in which every rank fills the
rows of its own blocks (zeros elsewhere). Ring cost per rank (``vb`` bytes per value)::

    rounds = 4 (P-1)
    bytes_received = floor(2(P-1) b / P) + floor(2(P-1) |U| block_size vb / P),  K <= |U| <= min(b, P K)

(OmniReduce proper streams non-zero blocks to aggregators; the bitmap + union all-reduce moves the
same blocks with collectives we have and is the form the S2 paper's comparison reduces to.)

``block_allgather`` — PyTorch's way for sparse gradients (gloo's sparse all-reduce = all-gather of
indices and values), at block granularity: every rank's ``(block ids, block values)`` in one fused
buffer (ids as int32 when ``b`` fits, then values), all-gathered by the ring, summed in rank order.
Dense path (every rank sends exactly ``K`` blocks: fixed size, plain ``allgather``)::

    rounds = P - 1,   bytes_received = (P-1) K (isize + block_size vb)

Embedding path: row counts differ per rank → ``allgatherv`` (padded to the largest; counts as
unrecorded headers). One fused all-gather instead of torch's two saves ``P-1`` latencies, same bytes.

``value_bits`` (2, 4, 8, 16; 32 / None: the above, bit for bit) on the dense path, as in ``topka`` and
``sparseloco`` (SparseLoCo, Sarfi et al., arXiv 2508.15706, 2025): the ``K`` block ids packed in
``w = ceil(log2 b)`` bits, then the ``K x block_size`` values as codes with a per-tensor table of bin
means (:func:`~sparsync.select.quantise.encode_message`) or fp16; the residual keeps each value minus its
decode (error feedback: conservation up to fp32 rounding, so not ``conserving``). With
``m = ceil(K w / 8) + ceil(K block_size bits / 8) + 4 * 2^bits`` (``2 K block_size`` for 16 bits)::

    rounds = P - 1,   bytes_received = (P-1) m

The embedding path (no error feedback there) sends its values as they are.

Summation orders are canonical (rank order / the all-reduce's), so outputs are bitwise identical on
every rank.
"""

from __future__ import annotations

import math

import torch

from ..select.blocks import num_blocks
from ..select.quantise import bits_for, check_value_bits, decode_message, encode_message, payload_bytes
from ..sketch import block_bitmap, blocks_from_bitmap
from ..sparse import index_dtype_for
from .blockbase import BlockReducer
from .capabilities import OptionFact
from .registry import register

__all__ = ["BlockAllgatherReducer", "BlockSparseReducer"]


def _padded_blocks(vals: torch.Tensor, nblk: int, block_size: int) -> torch.Tensor:
    """``(nblk, block_size)`` view of the flat values of sorted blocks; a short last block is zero padded."""
    missing = nblk * block_size - vals.numel()
    if missing:
        vals = torch.cat([vals, vals.new_zeros(missing)])
    return vals.view(nblk, block_size)


def _as(buf: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    es = torch.empty(0, dtype=dtype).element_size()
    piece = buf[start:start + count * es]
    if piece.storage_offset() % es:
        piece = piece.clone()
    return piece.view(dtype)


@register("blocksparse")
class BlockSparseReducer(BlockReducer):
    """OmniReduce-style block-sparse all-reduce: bitmap MAX all-reduce, then the union's blocks summed."""

    def _communicate(self, ids, idx, vals, nblocks, block_size, numel, expected, dense_path=True):
        dev = self.comm.device
        with self.timed("comm"):
            bitmap = block_bitmap(ids, nblocks, dtype=torch.uint8, device=dev)
            union = blocks_from_bitmap(self.comm.allreduce(bitmap, "max"))
            out = torch.zeros(nblocks, block_size, dtype=vals.dtype, device=dev)
            if union.numel():
                buf = torch.zeros(union.numel(), block_size, dtype=vals.dtype, device=dev)
                buf[torch.searchsorted(union, ids)] = _padded_blocks(vals, ids.numel(), block_size)
                out[union] = self.comm.allreduce(buf.view(-1), "sum").view(-1, block_size)
        self.stats["union_blocks"] = union.numel()
        self.stats["bitmap_entries"] = nblocks
        return out.view(-1)[:numel]

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, block_size=256, union_blocks=None, **_):
        """Two ring all-reduces (uint8 bitmap, then ``|U|`` blocks); ``|U|`` bounded by ``[K, min(b, PK)]``
        unless ``union_blocks`` is given. ``k`` = elements per rank (``K = ceil(k / block_size)``)."""
        b = num_blocks(n, block_size)
        K = min(b, max(1, math.ceil(k / block_size)))
        if P == 1:
            return {"rounds": 0, "bytes_received": 0}

        def vol(u):
            return 2 * (P - 1) * b // P + 2 * (P - 1) * (u * block_size * value_bytes) // P

        if union_blocks is not None:
            br = vol(int(union_blocks))
        else:
            br = (vol(K), vol(min(b, P * K)))
        return {"rounds": 4 * (P - 1), "bytes_received": br}


@register("block_allgather")
class BlockAllgatherReducer(BlockReducer):
    """All-gather of every rank's (block ids, block values), summed in rank order (PyTorch's way)."""

    #: not with decay (it sheds mass by design) nor packed values (a table's means round in fp32)
    conserving = OptionFact(True, lambda r: r.ef_decay == 1.0 and not r.packed)

    def __init__(self, comm, density: float = 0.01, value_bits: int | None = None, **rest):
        super().__init__(comm, density=density, **rest)
        self.value_bits = None if value_bits is None else check_value_bits(value_bits, self.name)
        self.packed = self.value_bits is not None and self.value_bits < 32
        self._ctx = None  # (values, their decode) of this step's packed message, for the residual

    def _communicate(self, ids, idx, vals, nblocks, block_size, numel, expected, dense_path=True):
        if dense_path and self.packed:
            return self._communicate_packed(ids, vals, nblocks, block_size, numel)
        dev = self.comm.device
        itype = index_dtype_for(nblocks)
        ib = torch.empty(0, dtype=itype).element_size()
        vb = vals.element_size()
        with self.timed("comm"):
            blocks = _padded_blocks(vals, ids.numel(), block_size)
            buf = torch.cat([ids.to(itype).view(torch.uint8), blocks.reshape(-1).view(torch.uint8)])
            bufs = self.comm.allgather(buf) if dense_path else self.comm.allgatherv(buf)
            out = torch.zeros(nblocks, block_size, dtype=vals.dtype, device=dev)
            for b_ in bufs:  # rank order: the same summation on every rank
                kr = b_.numel() // (ib + block_size * vb)
                if kr:
                    rid = _as(b_, 0, kr, itype).to(torch.int64)
                    rv = _as(b_, kr * ib, kr * block_size, vals.dtype).view(kr, block_size)
                    out.index_add_(0, rid, rv)
        return out.view(-1)[:numel]

    def _communicate_packed(self, ids, vals, nblocks, block_size, numel):
        """``value_bits`` < 32: one all-gather of equal-size packed messages, each decoded and added in
        rank order (the same bits on every rank); the sent values' decode is kept for :meth:`_feedback`."""
        bits, width, K = self.value_bits, bits_for(nblocks), ids.numel()
        with self.timed("select"):
            msg, dec = encode_message(ids, width, _padded_blocks(vals, K, block_size).reshape(-1), bits)
            self._ctx = (vals, dec[:vals.numel()])
        with self.timed("comm"):
            parts = self.comm.allgather(msg) if self.comm.world_size > 1 else [msg]
            out = torch.zeros(nblocks, block_size, dtype=torch.promote_types(vals.dtype, torch.float32),
                              device=self.comm.device)
            for m in parts:  # rank order: the same summation on every rank
                where, v = decode_message(m, K, width, bits, per=block_size)
                out.index_add_(0, where, v.view(K, block_size).to(out.dtype))
        return out.view(-1)[:numel]

    def _feedback(self, acc, idx):
        if self._ctx is None:
            return super()._feedback(acc, idx)
        vals, dec = self._ctx
        self._ctx = None
        self.memory.keep(acc, idx, dec, acc_vals=vals)  # the residual keeps the quantisation error

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, block_size=256, value_bits=None, **_):
        """Ring all-gather of ``K`` block ids + ``K`` blocks per rank (dense path, fixed size); with
        ``value_bits`` below 32 the packed message of the module docstring."""
        b = num_blocks(n, block_size)
        K = min(b, max(1, math.ceil(k / block_size)))
        if value_bits is not None and value_bits < 32:
            return {"rounds": P - 1, "bytes_received": (P - 1) * payload_bytes(K, bits_for(b), value_bits, block_size)}
        return {"rounds": P - 1, "bytes_received": (P - 1) * K * (index_bytes + block_size * value_bytes)}
