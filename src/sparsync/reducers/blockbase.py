"""The shared base of the block reducers (``s2``, ``blocksparse``, ``block_allgather``); not a reducer itself.

Contract (S2 Reducer paper, Ge et al., 2024, §2): :class:`BlockReducer` selects, on the dense path
(``reduce``), the ``K = round(density * b)`` blocks of ``block_size`` entries with the largest L2 norm
of ``acc = grad + residual`` (:mod:`sparsync.select.blocks`) and keeps the rest in the residual (local
error feedback); on the naturally sparse path (``reduce_sparse``) it takes a torch sparse COO gradient
(:func:`coo_rows`: coalesced first; its rows are the blocks; no error feedback). A subclass implements
only the communication, ``_communicate(ids, idx, vals, nblocks, block_size, numel, expected)``, which
returns the dense 1-D sum over ranks (bitwise the same on every rank). The registry skips this module.
"""

from __future__ import annotations

import math
import time

import torch

from ..select.blocks import block_topk, blocks_for_density, check_block_size, num_blocks
from ..select.topk import check_density
from ..sketch import block_elements
from .base import Reducer
from .memory import decay_memory
from .capabilities import OptionFact

__all__ = ["BlockReducer", "coo_rows"]


def coo_rows(grad: torch.Tensor):
    """``(row_ids sorted, row_values (nrows, D), shape)`` of a sparse COO gradient, coalescing it first.

    Accepts hybrid COO with one sparse dimension (embedding gradients: ``indices (1, nnz)``, values
    ``(nnz, *dense)``) and fully sparse 2-D COO. Raises ``TypeError``/``ValueError`` otherwise.
    """
    if not isinstance(grad, torch.Tensor) or grad.layout != torch.sparse_coo:
        layout = getattr(grad, "layout", type(grad).__name__)
        raise TypeError(f"reduce_sparse needs a torch sparse COO tensor (an embedding gradient), got {layout}")
    if not grad.dtype.is_floating_point:
        raise TypeError(f"reduce_sparse needs a floating-point gradient, got {grad.dtype}")
    if grad.dim() < 1:
        raise ValueError("reduce_sparse needs a sparse tensor with at least one dimension")
    if not grad.is_coalesced():  # nn.Embedding(sparse=True) emits one row per token, repeats included
        grad = grad.coalesce()
    shape = tuple(grad.shape)
    D = math.prod(shape[1:]) if len(shape) > 1 else 1
    ind, val = grad.indices(), grad.values()
    if grad.sparse_dim() == 1:
        return ind[0], val.reshape(ind.shape[1], D), shape
    if grad.sparse_dim() == 2 and grad.dim() == 2:
        rows, inverse = torch.unique(ind[0], sorted=True, return_inverse=True)
        block = torch.zeros(rows.numel(), D, dtype=val.dtype, device=val.device)
        block[inverse, ind[1]] = val
        return rows, block, shape
    raise ValueError(f"reduce_sparse supports COO tensors with sparse_dim 1 (embedding gradients) or a "
                     f"fully sparse 2-D tensor; got sparse_dim={grad.sparse_dim()}, dense_dim={grad.dense_dim()}")


class BlockReducer(Reducer):
    """Shared base: block top-K + error feedback for ``reduce``, COO handling for ``reduce_sparse``.

    Subclasses implement ``_communicate(ids, idx, vals, nblocks, block_size, numel, expected)`` that
    returns the dense 1-D sum (length ``numel``) and may set ``self._ctx`` for their feedback.
    """

    #: ``ef_decay`` below 1 sheds the residual's mass by design (SparseLoCo's error feedback)
    conserving = OptionFact(True, lambda r: r.ef_decay == 1.0)
    sparse_input = True  # reduce_sparse: embedding gradients (no error feedback on that path)

    def __init__(self, comm, density: float = 0.01, block_size: int = 256,
                 embedding_density: float | None = None, ef_decay: float = 1.0, **rest):
        super().__init__(comm, density=density, **rest)
        self.ef_decay = decay_memory(self.memory, ef_decay, self.name)
        self.block_size = check_block_size(block_size)
        self.embedding_density = self.density if embedding_density is None else check_density(embedding_density)
        self.sparse_stats: dict = {}
        self._checked_shapes: set = set()

    # ------------------------------------------------------------------ dense path
    @property
    def nblocks(self) -> int:
        return num_blocks(self.numel, self.block_size)

    @property
    def kblocks(self) -> int:
        """Blocks this rank transmits per dense step."""
        return blocks_for_density(self.nblocks, self.density)

    def _reduce(self, grad):
        bs, b = self.block_size, self.nblocks
        with self.timed("select"):
            acc = self.memory.add(grad)
            ids, idx, vals = block_topk(acc, self.kblocks, bs)
        self.stats["selected"] = idx.numel()
        self.stats["blocks_selected"] = ids.numel()
        out = self._communicate(ids, idx, vals, b, bs, self.numel, self.kblocks * bs)
        with self.timed("select"):
            self._feedback(acc, idx)
        return out

    def _feedback(self, acc: torch.Tensor, idx: torch.Tensor) -> None:
        self.memory.keep(acc, idx)

    # ------------------------------------------------------------------ embedding path
    def reduce_sparse(self, grad: torch.Tensor) -> torch.Tensor:
        """SUM over ranks of a sparse COO embedding gradient, as a dense tensor of the same shape.

        Uncoalesced input is coalesced first. Bitwise identical on every rank. No error feedback.
        """
        self.stats = {"select_s": 0.0, "comm_s": 0.0}
        snap = self.comm.ledger.snapshot()
        t0 = time.perf_counter()
        with self.timed("select"):
            rows, block, shape = coo_rows(grad)
        self.check_finite(block)
        if shape not in self._checked_shapes:
            self.comm.check_same(len(shape), "sparse gradient rank")
            for i, s in enumerate(shape):
                self.comm.check_same(s, f"sparse gradient dim {i}")
            self._checked_shapes.add(shape)
        V, D = shape[0], block.shape[1]
        n = V * D
        rows = rows.to(self.comm.device)
        block = block.to(self.comm.device)
        idx = block_elements(rows, D, n)
        expected = max(1, round(self.embedding_density * V)) * D
        with self.comm.phase(self.name + ":sparse"):
            out = self._communicate(rows, idx, block.reshape(-1), V, D, n, expected, dense_path=False)
        self._sync()
        cost = self.comm.ledger.since(snap)
        self.stats.update(selected=idx.numel(), density=idx.numel() / max(1, n), blocks_selected=rows.numel(),
                          target_density=self.embedding_density,
                          bytes_sent=cost["bytes_sent"], bytes_received=cost["bytes_received"],
                          messages=cost["messages_sent"], rounds=cost["rounds"],
                          total_s=time.perf_counter() - t0)
        self.sparse_stats = self.stats
        return out.view(shape)

    # ------------------------------------------------------------------ subclass hook
    def _communicate(self, ids, idx, vals, nblocks, block_size, numel, expected, dense_path=True):
        raise NotImplementedError
