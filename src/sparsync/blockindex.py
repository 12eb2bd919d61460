"""Sorted indices of a known range on the wire as 16-bit offsets: half the bytes of int32 indices.

What: a rank's selected indices ``idx`` (strictly increasing, all in ``[start, start + length)``)
travel as one int16 message::

    [ counts of the nb = ceil(length / 65536) blocks, int32 each, as 2 nb int16 words ]
    [ (idx - start) mod 65536 - 32768, one int16 word per index ]

The receiver knows ``start``, ``length`` and the count (the same bounds on every rank), rebuilds the
block of each index from the counts (``repeat_interleave``: indices are sorted, so block ``b``'s
entries are consecutive) and adds the low 16 bits back. ``2 * (2 nb + c)`` bytes instead of
``4 c``: it pays once ``c > 2 nb`` - at n = 4.35M over P = 4 ranks (nb = 17), from 35 indices on.

Why: MiCRO's index all-gather is a third to a half of its bytes, so indices travel in the smallest
type that fits. A fixed-width delta cannot be
narrower than the largest gap; offsets within 65536-entry blocks have no such bound, need no
escape codes, and keep the message size known from the count alone, so the padded all-gather
(sizes known from the calibration) still needs no size exchange. Encoding is a ``searchsorted`` of
the block edges and three element-wise ops over the ``c`` indices, decoding a ``repeat_interleave``
and an add - no pass over ``n``, but more CPU per call than plain int32 indices, which is why micro
uses it only with half-precision values (where the bytes saved are the larger share).
"""

from __future__ import annotations

import math

import torch

from . import native

__all__ = ["block_count", "block16_bytes", "block16_pays", "encode_block16", "decode_block16", "gather_block16"]

BLOCK = 1 << 16


def block_count(length: int) -> int:
    """``nb = ceil(length / 65536)`` blocks of a range of ``length`` entries (at least 1)."""
    return max(1, math.ceil(int(length) / BLOCK))


def block16_bytes(count: int, nb: int) -> int:
    """Bytes of one message: ``2 * (2 nb + count)``."""
    return 2 * (2 * nb + int(count))


def block16_pays(max_count: int, nb: int, index_bytes: int = 4) -> bool:
    """True when the padded message (``max_count`` indices) is smaller than plain indices."""
    return block16_bytes(max_count, nb) < int(max_count) * int(index_bytes)


def encode_block16(idx: torch.Tensor, start: int, nb: int) -> torch.Tensor:
    """The int16 message of sorted ``idx`` in ``[start, start + nb * 65536)`` (layout above).

    Counts by ``searchsorted`` of the block edges (the indices are sorted: cheaper than a
    ``bincount`` on CPU)."""
    idx = idx.to(torch.int64)
    edges = torch.arange(nb + 1, dtype=torch.int64, device=idx.device) * BLOCK + int(start)
    pos = torch.searchsorted(idx, edges)
    out = torch.empty(2 * nb + idx.numel(), dtype=torch.int16, device=idx.device)
    out[:2 * nb] = (pos[1:] - pos[:-1]).to(torch.int32).view(torch.int16)
    out[2 * nb:] = (idx - int(start)).bitwise_and_(BLOCK - 1).sub_(BLOCK // 2)  # a new tensor: idx untouched
    return out


def decode_block16(msg: torch.Tensor, start: int, nb: int, count: int) -> torch.Tensor:
    """The ``count`` int64 indices of a message made by :func:`encode_block16` (padding ignored).

    One ``repeat_interleave`` of the blocks' first index and one in-place add of the offsets
    (converted first: a mixed int64 + int16 add is slower). On the CPU
    with the C kernels (:mod:`sparsync.native`) one loop over the message instead: the same indices."""
    if msg.device.type == "cpu" and msg.dtype == torch.int16 and msg.is_contiguous() and native.enabled():
        return native.decode_block16(msg, start, nb, count)
    counts = msg[:2 * nb].clone().view(torch.int32).to(torch.int64)  # clone: aligned for the view
    base = torch.arange(nb, dtype=torch.int64, device=msg.device) * BLOCK + (int(start) + BLOCK // 2)
    out = torch.repeat_interleave(base, counts, output_size=count)
    return out.add_(msg[2 * nb:2 * nb + count].to(torch.int64))


def gather_block16(idx: torch.Tensor, counts: list[int], starts: list[int], rank: int, nb: int,
                   gather_padded) -> list[torch.Tensor]:
    """Every rank's sorted int64 indices, in rank order, from one exchange of their block16 messages.

    Rank ``r`` holds ``counts[r]`` indices in ``[starts[r], starts[r] + nb * 65536)`` (known to every
    rank); this rank's are ``idx``. ``gather_padded(msg, sizes)`` exchanges the uint8 messages (gloo
    has no int16) padded to the largest size (:func:`sparsync.comm.gather_padded`). This rank's own
    list is ``idx`` itself (``decode(encode(idx)) == idx``)."""
    msg = encode_block16(idx, starts[rank], nb).view(torch.uint8)
    got = gather_padded(msg, [block16_bytes(c, nb) for c in counts])
    return [idx.to(torch.int64) if r == rank else decode_block16(m.view(torch.int16), s, nb, c)
            for r, (m, s, c) in enumerate(zip(got, starts, counts))]
