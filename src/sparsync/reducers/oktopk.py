"""``oktopk``: Ok-Topk (Li & Hoefler), as characterised by SparDL (``spec/spardl.md`` §10).

Per step on rank ``w``:

1. **local selection by a reused threshold**: ``acc = grad + residual``; entries with
   ``|acc| >= th_local``. Every ``recompute_every`` steps (default 32, and at step 0) ``th_local`` is
   re-evaluated exactly as the ``k``-th largest ``|acc|``; in between it is reused (two cheap passes).
2. **balanced split-and-reduce**: the index space is cut into ``P`` regions whose boundaries are
   re-balanced every ``balance_every`` steps (default 64) so that every region holds about the same
   number of selected indices (a histogram of ``64 P`` bins, summed with a small all-reduce).
   ``alltoallv`` sends each rank's entries of region ``j`` to rank ``j``, which sums them in rank order.
3. **global selection by a reused threshold**: rank ``j`` keeps the entries of its region with
   ``|v| >= th_global``; ``th_global`` is re-evaluated at the same steps as ``th_local`` as the ``k``-th
   largest reduced magnitude over all regions, to within one bin of a 1024-bin log-magnitude
   histogram summed with a small all-reduce (:meth:`OkTopkReducer._global_threshold`).
4. ``allgatherv`` of the kept entries -> everyone builds the same dense sum (regions are disjoint).

Residuals (Ok-Topk): local residual plus the locally selected values whose index did not survive the
global selection (end-procedure, "put back"). Here this is conserving: an index is either kept
globally with the full sum of every rank's contribution (regions are disjoint, nothing is re-selected
inside a region) or dropped entirely, and then every contributor gets its own value back.

Cost (steady state, no re-evaluation): ``alltoallv`` ``P-1`` rounds + ring ``allgatherv`` ``P-1`` rounds
(Table I: ``2(P + log P)``); bytes about ``4(P-1)/P k`` units, within Table I's ``[2(P-1)/P k,
6(P-1)/P k]`` when the reused thresholds still select about ``k`` entries (they can exceed it, as the
table notes). Sizes are data dependent: headers are paid (``alltoallv`` counts, ``allgatherv`` counts).
Re-evaluation steps add two small all-reduces (threshold) and balancing steps one small ``allreduce``.
"""

from __future__ import annotations

import torch

from ..spardl.wire import pack, pair_bytes, unpack
from .base import Reducer
from .registry import register
from .topkdsa import select_topk

_BINS_PER_RANK = 64
_TH_BINS = 1024


@register("oktopk")
class OkTopkReducer(Reducer):
    def __init__(self, comm, density=0.01, recompute_every=32, balance_every=64, **rest):
        super().__init__(comm, density=density, **rest)
        if int(recompute_every) < 1 or int(balance_every) < 1:
            raise ValueError("recompute_every and balance_every must be >= 1")
        self.recompute_every = int(recompute_every)
        self.balance_every = int(balance_every)
        self.th_local: float | None = None
        self.th_global: float | None = None
        self.bounds: list[int] | None = None
        self._scratch: dict = {}

    def _reduce(self, grad):
        comm = self.comm
        P, _w, n, k = comm.world_size, comm.rank, self.numel, self.k
        recompute = self.th_local is None or self.step % self.recompute_every == 0
        with self.timed("select"):
            acc = self.accumulate(grad)
            if recompute:
                idx = select_topk(acc, k, self._scratch)
                self.th_local = float(acc[idx].abs().min()) if idx.numel() else 0.0
            else:
                idx = torch.nonzero(acc.abs() >= self.th_local).flatten()
            vals = acc[idx]
        self.stats["selected"] = idx.numel()
        if self.bounds is None or self.step % self.balance_every == 0:
            with comm.phase("oktopk:balance"), self.timed("comm"):
                self.bounds = self._balance(idx, n, P)
        b = self.bounds
        with self.timed("select"):
            cuts = torch.searchsorted(idx, torch.tensor(b, dtype=idx.dtype, device=idx.device)).tolist()
            parts = [pack(idx[cuts[j]:cuts[j + 1]], vals[cuts[j]:cuts[j + 1]]) for j in range(P)]
        with comm.phase("oktopk:reduce-scatter"), self.timed("comm"):
            got = comm.alltoallv(parts) if P > 1 else parts
        with self.timed("select"):
            pb = pair_bytes(acc.dtype)
            lists = [unpack(x, 1, x.numel() // pb, acc.dtype) for x in got]
            ri, inv = torch.unique(torch.cat([li[0] for li, _ in lists]), return_inverse=True)
            rv = torch.zeros(ri.numel(), dtype=acc.dtype, device=acc.device)
            rv.index_add_(0, inv, torch.cat([v[0] for _, v in lists]))
        if recompute:
            with comm.phase("oktopk:threshold"), self.timed("comm"):
                self.th_global = self._global_threshold(rv.abs(), k)
        with self.timed("select"):
            keep = rv.abs() >= self.th_global
            gi, gv = ri[keep], rv[keep]
        with comm.phase("oktopk:allgather"), self.timed("comm"):
            bufs = comm.allgatherv(pack(gi, gv)) if P > 1 else [pack(gi, gv)]
        with self.timed("select"):
            out = torch.zeros(n, dtype=acc.dtype, device=acc.device)
            fin = []
            for x in bufs:
                fi, fv = unpack(x, 1, x.numel() // pb, acc.dtype)
                out[fi[0]] = fv[0]
                fin.append(fi[0])
            sent = idx[torch.isin(idx, torch.cat(fin))]
            self.keep_unsent(acc, sent)  # own values outside the global set stay (end-procedure)
        return out

    def _global_threshold(self, mags: torch.Tensor, k: int) -> float:
        """About the k-th largest reduced magnitude over all regions, from two small all-reduces.

        A max/min all-reduce fixes the log2-magnitude range, a ``_TH_BINS``-bin histogram of every
        region's log2 magnitudes is summed, and the threshold is the lower edge of the bin where the
        count from the top first reaches ``k`` (so ``k`` to ``k + one bin`` entries pass). Exact
        alternatives (gathering up to ``k`` magnitudes from every region) cost ``(P-1) k`` values.
        """
        comm = self.comm
        pos = mags[mags > 0]
        lg = torch.log2(pos.to(torch.float64))
        ext = torch.tensor([float(lg.max()) if lg.numel() else -1e300,
                            -float(lg.min()) if lg.numel() else -1e300], dtype=torch.float64, device=mags.device)
        if comm.world_size > 1:
            ext = comm.allreduce(ext, "max")
        hi, lo = float(ext[0]), -float(ext[1])
        if hi < lo:  # no nonzero anywhere
            return 0.0
        width = max((hi - lo) / _TH_BINS, 1e-12)
        b = torch.clamp(((lg - lo) / width).floor().long(), 0, _TH_BINS - 1)
        hist = torch.bincount(b, minlength=_TH_BINS).to(torch.float64)
        if comm.world_size > 1:
            hist = comm.allreduce(hist)
        from_top = torch.cumsum(hist.flip(0), 0)
        j = int(torch.searchsorted(from_top, torch.tensor([float(k)], dtype=torch.float64, device=from_top.device))[0])
        j = min(j, _TH_BINS - 1)
        return float(2.0 ** (lo + (_TH_BINS - 1 - j) * width)) * (1 - 1e-12)

    def _balance(self, idx, n, P):
        nb = P * _BINS_PER_RANK
        width = -(-n // nb)
        hist = torch.bincount(torch.div(idx, width, rounding_mode="floor"), minlength=nb).to(torch.float64)
        if P > 1:
            hist = self.comm.allreduce(hist)
        cum = torch.cumsum(hist, 0)
        total = float(cum[-1])
        if total == 0:
            ps = -(-n // P)
            return [min(n, j * ps) for j in range(P + 1)]
        targets = torch.tensor([total * j / P for j in range(1, P)], dtype=torch.float64, device=cum.device)
        edges = (torch.searchsorted(cum, targets) + 1).tolist()
        out = [0] + [min(n, e * width) for e in edges] + [n]
        for j in range(1, P + 1):  # monotone
            out[j] = max(out[j], out[j - 1])
        return out

    def _extra_state(self):
        return {"th_local": self.th_local, "th_global": self.th_global, "bounds": self.bounds}

    def _load_extra_state(self, s):
        self.th_local, self.th_global, self.bounds = s.get("th_local"), s.get("th_global"), s.get("bounds")

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, counts=None, **_):
        """This code's ledger on a steady-state step (no threshold re-evaluation, no re-balancing),
        maximum over ranks: ``2(P-1)`` rounds (``alltoallv`` + ring ``allgatherv``); bytes depend on
        where the selected indices fall, so they are bounds, from the per-rank selected ``counts``
        (default ``k`` each): the ``alltoallv`` brings at most every other rank's selection
        (``sum - min``), the ``allgatherv`` at most ``P-1`` region lists of at most ``sum`` entries.
        Re-evaluation steps add two small all-reduces, balancing steps one. The paper's Table I
        figures are :meth:`table_cost`."""
        if P <= 1:
            return {"rounds": 0, "bytes_received": 0}
        c = [k] * P if counts is None else [int(x) for x in counts]
        pb = index_bytes + value_bytes
        return {"rounds": 2 * (P - 1), "bytes_received": (0, (sum(c) - min(c) + (P - 1) * sum(c)) * pb)}

    @staticmethod
    def table_cost(P, k):
        """Table I: ``2(P + log2 P)`` rounds, ``[2, 6](P-1)/P k`` units (a COO pair = 2 units)."""
        lg = (P - 1).bit_length()
        return {"rounds": 2 * (P + lg), "units": (2 * (P - 1) / P * k, 6 * (P - 1) / P * k)}
