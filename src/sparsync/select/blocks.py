"""Block-wise top-K by block L2 norm (S2 Reducer's sparsifier for dense models: Ge et al. 2021, §2).

The flat gradient of length ``n`` is viewed as ``b = ceil(n / block_size)`` blocks of
``block_size`` consecutive elements. Each block's L2 norm is computed and the ``K`` blocks with the
largest norms are kept *whole*; everything else is zero (and stays in the error-feedback residual).

**Padding rule** (block size not dividing ``n``): the last block is the short tail
``[(b-1)*block_size, n)``, conceptually padded with zeros to ``block_size`` elements. Zero padding
does not change its L2 norm, so the tail competes fairly; the padding is never transmitted as
gradient, never stored, and is dropped from every index list (:func:`block_elements`). No copy of
the gradient is made: the full blocks are a view, the tail's norm is computed separately.

``K`` from a density: ``K = min(b, max(1, round(density * b)))`` (the paper's "1/32 compression
rate" is ``density = 1/32``). Ties between equal norms go to the lower block id
(:func:`sparsync.select.exact.topk_indices`), the same on every rank and device.

Cost: one pass over the gradient (the norms), an exact top-K over ``b`` norms (cheap: ``b = n /
block_size``), and a gather of ``K * block_size`` values.
"""

from __future__ import annotations

import math

import torch

from ..sketch import block_elements
from .exact import topk_indices
from .topk import k_for_density

__all__ = [
    "block_elements",
    "block_norms",
    "block_topk",
    "blocks_for_density",
    "check_block_size",
    "num_blocks",
]


def check_block_size(block_size) -> int:
    """A block size is an integer >= 1."""
    is_int = isinstance(block_size, int) and not isinstance(block_size, bool)
    if not is_int and not (isinstance(block_size, float) and block_size.is_integer()):
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    bs = int(block_size)
    if bs < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    return bs


def num_blocks(numel: int, block_size: int) -> int:
    """``ceil(numel / block_size)``: the last block may be short (zero padded)."""
    return math.ceil(int(numel) / check_block_size(block_size))


def blocks_for_density(nblocks: int, density: float) -> int:
    """Blocks kept at ``density``: ``min(b, max(1, round(density * b)))``."""
    return k_for_density(nblocks, density)


def block_norms(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """L2 norm of every block of the 1-D ``x`` (length ``ceil(n / block_size)``; tail zero padded)."""
    if x.dim() != 1:
        raise ValueError(f"block_norms needs a 1-D tensor, got shape {tuple(x.shape)}")
    bs = check_block_size(block_size)
    n = x.numel()
    full = n // bs
    norms = torch.linalg.vector_norm(x[: full * bs].view(full, bs), dim=1)
    if full * bs < n:
        tail = torch.linalg.vector_norm(x[full * bs:]).view(1)
        norms = torch.cat([norms, tail])
    return norms


def block_topk(x: torch.Tensor, nblocks_kept: int, block_size: int):
    """The ``K`` blocks of largest L2 norm of the 1-D ``x``.

    Returns ``(block_ids, idx, values)``: sorted int64 block ids, the flat element indices of those
    blocks (ascending, padding dropped) and ``x[idx]``.
    """
    bs = check_block_size(block_size)
    norms = block_norms(x, bs)
    b = norms.numel()
    K = int(nblocks_kept)
    if not 0 <= K <= b:
        raise ValueError(f"number of kept blocks must be in [0, {b}], got {K}")
    if K == b:
        ids = torch.arange(b, device=x.device)
    else:
        ids = topk_indices(norms, K)
    idx = block_elements(ids, bs, x.numel())
    return ids, idx, x.index_select(0, idx)
