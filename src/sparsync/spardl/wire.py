"""Fixed-capacity (index, value) lists packed into one uint8 message.

Layout (struct of arrays): ``m*c`` int32 block-local indices, then ``m*c`` values, for ``m`` blocks of
exactly ``c`` pairs each. The size ``m*c*(4 + value_bytes)`` is known to the receiver, so no header.
Block-local indices fit int32 because a block is at most ``n`` elements and ``n < 2^31`` is checked.
"""

from __future__ import annotations

import torch

__all__ = ["pack", "pair_bytes", "unpack"]


def pair_bytes(dtype: torch.dtype) -> int:
    return 4 + torch.empty(0, dtype=dtype).element_size()


def pack(idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``idx`` (any int dtype) and ``vals`` of the same shape -> one uint8 buffer."""
    i = idx.to(torch.int32).contiguous().view(-1).view(torch.uint8)
    v = vals.contiguous().view(-1).view(torch.uint8)
    return torch.cat([i, v])


def unpack(buf: torch.Tensor, m: int, c: int, dtype: torch.dtype):
    """Inverse of :func:`pack`: ``(idx int64 [m, c], vals [m, c])``."""
    ni = m * c * 4
    i = buf[:ni].clone().view(torch.int32).to(torch.int64).view(m, c)
    v = buf[ni:].clone().view(dtype).view(m, c)
    return i, v
