"""What every :class:`~sparsync.comm.Comm` call shares: messages are 1-D tensors, a posted receive is a
:class:`Handle`, a misuse is a :class:`CommError`; and :func:`gather_padded`, the variable-size
all-gather as one fixed-size gather of tensors zero-padded to the largest count.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["CommError", "Handle", "as_1d", "gather_padded", "nbytes"]


def gather_padded(t: torch.Tensor, counts: list[int], gather) -> list[torch.Tensor]:
    """Every rank's ``t`` (``counts[r]`` elements on rank ``r``), in rank order, by one fixed-size
    ``gather`` (tensor -> list in rank order) of ``t`` zero-padded to ``max(counts)``."""
    m = max(counts)
    if m == 0:
        return [t.new_empty(0) for _ in counts]
    padded = t if t.numel() == m else torch.cat([t, t.new_zeros(m - t.numel())])
    return [x[:c] for x, c in zip(gather(padded), counts)]


class CommError(RuntimeError):
    """A communication call was used wrongly (mismatched collectives, bad peer, bad sizes)."""


class Handle:
    """A posted receive (or send); ``wait()`` returns the received tensor (or None for a send)."""

    def __init__(self, waiter: Callable[[], torch.Tensor | None]):
        self._waiter = waiter
        self._done = False
        self._value = None

    def wait(self):
        if not self._done:
            self._value = self._waiter()
            self._done = True
        return self._value


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def as_1d(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as a contiguous 1-D message; TypeError / ValueError naming ``what`` otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{what}: messages are 1-D tensors, got shape {tuple(t.shape)}")
    return t.contiguous()
