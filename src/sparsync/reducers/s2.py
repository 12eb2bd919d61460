"""``s2``: S2 Reducer — sparse gradients aggregated as a count sketch plus a block bitmap.

Ge et al., "S2 Reducer", 2022 (Algorithm 1, §4). Per call, on every rank:

1. sparsify: block-wise top-K by block L2 norm with local error feedback (dense gradients,
   :meth:`reduce`), or the touched rows of an embedding gradient (:meth:`reduce_sparse`, no error
   feedback) — both from :class:`~sparsync.reducers.blockbase.BlockReducer`;
2. encode the selected elements into an ``r x c`` count sketch whose hashes and signs come from one
   shared ``seed`` (identical on every rank; :class:`sparsync.sketch.CountSketch`), and set the bitmap
   of this rank's non-zero blocks;
3. **one** dense SUM all-reduce of the concatenation ``[sketch (r*c values) | bitmap (b values)]``
   (the bitmap is carried in the gradient's float type; sums of ones never round to zero);
4. decompress: the blocks whose summed bitmap entry is ``> 0`` are exactly the union support (at
   block granularity); every element of those blocks is estimated by the median over rows of
   ``s_j(i) * S[j, h_j(i)]``; everything else is 0.

The output is the estimate of the SUM over ranks (the contract: averaging happens in the trainer;
a "divide by W" variant is therefore not applied here). Steps 3-4 are
deterministic functions of the all-reduced buffer, so the output is bitwise identical on all ranks.

**The sketch is lossy.** Hash collisions add other elements' (signed) mass to an estimate; with
``r = 1`` the estimate is unbiased over the random hashes with variance
``~ ||g_U||^2 / c`` per element, and a median of ``r >= 3`` rows concentrates but is not unbiased.
Sizing: ``c = columns`` if given, else ``c = ceil(ratio * alpha_d / r)`` with the paper's
``lambda = ratio`` (default 0.5) and ``alpha_d`` the *configured* per-rank non-zero count
(``K * block_size`` for dense gradients; ``round(embedding_density * rows) * dim`` for embeddings) so
the size is the same on every rank and every step.

**Error feedback and conservation.** Default (``sketch_feedback=False``, the paper's Theorem 2
setting): only the block top-K residual is kept (``residual = acc`` without the sent blocks); the
sketch's estimation error is global and is *not* fed back, so mass is lost or invented every step:
``conserving = False``. Option ``sketch_feedback=True`` (requires ``rows=1``) makes it conserving:
with one row the query is linear, ``out = sum_r Q_U(S_r)`` where ``Q_U(S_r)`` is the query of rank
``r``'s own sketch at the recovered elements ``U``; each rank therefore keeps
``residual = acc - Q_U(S_r)`` (the unsent mass plus minus its own share of the collision error), and
``sum_r (grad_r + res_before_r) = out + sum_r res_after_r`` holds up to fp rounding. It costs one extra
local query. Embedding gradients never get error feedback. Two stability conditions (found by
experiment, ``docs/s2.md``): the hashes must change every step (``rehash``, implied; with fixed hashes
elements sharing a bucket step after step form a loop ``e <- -(A - I) e`` whose gain is the bucket
occupancy minus one, so the residual grows geometrically), and the sketch must be larger than the
paper's ``lambda = 0.5`` (the fed-back noise has ~``|U|/c`` times the sent energy; bounded for
``ratio >= 2`` at P = 4 in our runs, divergent at 0.5).

``rehash=True`` draws the hashes of call ``t`` from seed ``seed * 1_000_003 + t`` (same on every rank),
so collision errors are independent across steps instead of repeating.

Ring cost per rank, independent of overlap::

    rounds = 2 (P-1),   bytes_received = floor(2(P-1) (r c + b) vb / P)

Stats (beyond the base class): ``sketch_rows``, ``sketch_columns``, ``sketch_cells``,
``bitmap_entries``, ``union_blocks``, ``blocks_selected``, ``encode_s``, ``decode_s``.

Hashes are computed from the indices on the fly, or gathered from per-index tables built once per
tensor when the hashes are fixed and ``rows * numel <= hash_cache`` (default 2^25 entries, 160 MiB;
``hash_cache=0`` disables).
"""

from __future__ import annotations

import math

import torch

from ..select.blocks import num_blocks
from ..sketch import CountSketch, block_bitmap, block_elements, blocks_from_bitmap, sketch_columns
from .blockbase import BlockReducer
from .capabilities import OptionFact
from .registry import register

__all__ = ["S2Reducer"]


@register("s2")
class S2Reducer(BlockReducer):
    conserving = OptionFact(False, lambda r: r.sketch_feedback)  # the sketch error kept only with feedback

    def __init__(self, comm, density: float = 0.01, rows: int = 1, columns: int | None = None,
                 ratio: float | None = None, block_size: int = 256, seed: int = 42,
                 sketch_feedback: bool = False, rehash: bool | None = None, embedding_density: float | None = None,
                 hash_cache: int = 2**25, **rest):
        super().__init__(comm, density=density, block_size=block_size,
                         embedding_density=embedding_density, **rest)
        sketch_columns(1, rows, columns, ratio)  # validates rows / columns / ratio now, not at step 1
        self.rows = int(rows)
        self.columns = None if columns is None else int(columns)
        self.ratio = 0.5 if (ratio is None and columns is None) else ratio
        self.seed = int(seed)
        self.sketch_feedback = bool(sketch_feedback)
        self.rehash = self.sketch_feedback if rehash is None else bool(rehash)
        if self.sketch_feedback and not self.rehash:
            raise ValueError("sketch_feedback needs rehash=True: with fixed hashes the fed-back collision error "
                             "of elements that share a bucket step after step grows geometrically")
        self._sparse_calls = 0
        self.hash_cache = int(hash_cache)
        if self.sketch_feedback and self.rows != 1:
            raise ValueError("sketch_feedback needs rows=1: the median of several rows is not linear, so the "
                             "ranks' shares of the sketch error are not defined")
        self._sketches: dict = {}
        self._own_query = None

    # ------------------------------------------------------------------ sketch per tensor shape
    def sketch_for(self, expected_nnz: int, call: int | None = None, numel: int | None = None) -> CountSketch:
        """The sketch for a tensor whose configured per-rank non-zero count is ``expected_nnz``.

        Fixed hashes (seed ``seed``) unless ``rehash``: then call number ``call`` (the step for dense
        gradients, the count of ``reduce_sparse`` calls for embeddings; equal on every rank) hashes with
        seed ``seed * 1_000_003 + call``. With fixed hashes and ``rows * numel <= hash_cache`` the
        hashes of all ``numel`` indices are tabulated once (5 bytes per index and row)."""
        c = sketch_columns(expected_nnz, self.rows, self.columns, None if self.columns else self.ratio)
        seed = self.seed if not self.rehash or call is None else self.seed * 1_000_003 + int(call)
        key = (c, numel)
        sk = self._sketches.get(key)
        if sk is None or sk.seed != seed:
            sk = self._sketches[key] = CountSketch(self.rows, c, seed, device=self.comm.device)
            if numel and not self.rehash and self.rows * numel <= self.hash_cache:
                sk.precompute(numel)
        return sk

    def _communicate(self, ids, idx, vals, nblocks, block_size, numel, expected, dense_path=True):
        if dense_path:
            call = self.step
        else:
            call, self._sparse_calls = self._sparse_calls, self._sparse_calls + 1
        sk = self.sketch_for(expected, call, numel)
        with self.timed("encode"):
            table = sk.encode(idx, vals)
            # the cells sum several values each: finite input can overflow them (the sum test, then the exact one)
            if self.nonfinite != "ignore" and not (torch.isfinite(table.sum()) or torch.isfinite(table).all()):
                raise FloatingPointError(
                    f"rank {self.comm.rank}: s2.reduce: the count sketch overflowed at step {self.step}: a cell sums "
                    f"values up to {float(vals.abs().max()):.3g} past the float range; nothing was sent. Lower the "
                    "learning rate or clip the gradient")
            buf = torch.cat([table.view(-1), block_bitmap(ids, nblocks, dtype=vals.dtype, device=table.device)])
        with self.timed("comm"):
            summed = self.comm.allreduce(buf, "sum")
        with self.timed("decode"):
            union = blocks_from_bitmap(summed[sk.size:])
            q_idx = block_elements(union, block_size, numel)
            out = torch.zeros(numel, dtype=vals.dtype, device=table.device)
            out[q_idx] = sk.query(summed[:sk.size].view(sk.rows, sk.columns), q_idx)
        if dense_path and self.sketch_feedback:
            with self.timed("encode"):
                self._own_query = (q_idx, sk.query(table, q_idx))
        self.stats.update(sketch_rows=sk.rows, sketch_columns=sk.columns, sketch_cells=sk.size,
                          bitmap_entries=nblocks, union_blocks=union.numel())
        return out

    def _feedback(self, acc, idx):
        if not self.sketch_feedback:
            return super()._feedback(acc, idx)
        q_idx, own = self._own_query
        self._own_query = None
        # residual = acc - Q_U(own sketch) on the union's elements (unique)
        self.memory.keep(acc, q_idx, own, acc_vals=acc.index_select(0, q_idx))

    # ------------------------------------------------------------------ state / cost
    def _config(self) -> dict:
        return {"rows": self.rows, "columns": self.columns, "ratio": self.ratio, "seed": self.seed,
                "block_size": self.block_size, "sketch_feedback": self.sketch_feedback, "rehash": self.rehash}

    def _extra_state(self) -> dict:
        return {"config": self._config(), "sparse_calls": self._sparse_calls}

    def _load_extra_state(self, d: dict) -> None:
        cfg = d.get("config")
        if cfg is not None and cfg != self._config():
            raise ValueError(f"s2 state was saved with {cfg}, this reducer has {self._config()}")
        self._sparse_calls = int(d.get("sparse_calls", 0))

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, block_size=256, rows=1, columns=None,
                       ratio=None, **_):
        """One ring all-reduce of ``r*c`` sketch cells + ``b`` bitmap entries.

        ``k`` = elements per rank; ``K = ceil(k / block_size)`` blocks and ``alpha_d = K * block_size``
        size the sketch exactly as the reducer does."""
        b = num_blocks(n, block_size)
        K = min(b, max(1, math.ceil(k / block_size)))
        c = sketch_columns(K * block_size, rows, columns,
                           None if columns is not None else (0.5 if ratio is None else ratio))
        if P == 1:
            return {"rounds": 0, "bytes_received": 0}
        return {"rounds": 2 * (P - 1), "bytes_received": 2 * (P - 1) * ((rows * c + b) * value_bytes) // P}
