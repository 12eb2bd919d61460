"""``oktopk``: Ok-Topk (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP
2022), as characterised by the SparDL paper.

Per step on rank ``w``:

1. **local selection**: ``acc = grad + residual``; the exact top-``k`` of ``|acc|``
   (:func:`sparsync.select.exact.topk_indices`, about one memory pass - as cheap as the threshold
   pass the paper reuses its local threshold for). ``th_local`` is its ``k``-th magnitude (reported).
2. **balanced split-and-reduce**: the index space is cut into ``P`` regions whose boundaries are
   re-balanced every ``balance_every`` steps (default 64) so that every region holds about the same
   number of selected indices (a histogram of ``64 P`` bins, summed with a small all-reduce).
   ``alltoallv`` sends each rank's entries of region ``j`` to rank ``j``, which sums them in rank order.
3. **global selection by a threshold**: rank ``j`` keeps the entries of its region with
   ``|v| >= th_global``; ``th_global`` is re-evaluated every ``recompute_every`` steps (default 1,
   every step) as the ``k``-th largest reduced magnitude over all regions, to a relative ``2^-12``:
   a radix select on the fp32 bit pattern, two 1024-bin histograms exchanged with small all-gathers
   (:meth:`OkTopkReducer._global_threshold`); in between it is reused.
4. all-gather of the kept entries -> everyone builds the same dense sum (regions are disjoint); on a
   threshold step every region's count is known from the histograms (one padded all-gather, no count
   round), otherwise ``allgatherv``.

**Steady state with error feedback** (why the defaults differ from the paper's 32-step reuse): with
the residual kept between calls, a threshold estimated once and reused drifts far from the target.
Measured on thread ranks (4 ranks, a heavy-tailed synthetic workload, n = 2e5, 1 %): a local
threshold reused for 32 steps selected 3.6x ``k`` after 3 steps and 15x after 30 (it was estimated
on an accumulator whose residual had not built up; every entry left below it keeps growing until it
crosses), and a global threshold reused after an exact estimate selected 2.4-2.8x ``k`` from the
next step on (the values dropped by the global selection go back into the residuals, are re-selected
locally and arrive larger). Exact local top-``k`` every step and the global estimate every step keep
the local count at exactly ``k`` and the global one at ``k`` to ``1.01 k`` over 60 steps (same set-up;
``tests/reducers/test_oktopk_steady.py`` asserts 10 %); ``recompute_every=32`` reproduces the paper's reuse.

Residuals (Ok-Topk): local residual plus the locally selected values whose index did not survive the
global selection (end-procedure, "put back"). Here this is conserving: an index is either kept
globally with the full sum of every rank's contribution (regions are disjoint, nothing is re-selected
inside a region) or dropped entirely, and then every contributor gets its own value back.

Passes over the ``n`` entries per call (the rest is ``O(k)``): ``acc = grad + residual`` into a
recycled buffer (:class:`~sparsync.reducers.memory.ErrorFeedback`), one read by the exact top-k
kernel, one zero fill of the recycled output (:meth:`~sparsync.reducers.base.Reducer.zeros_output`);
which own entries the global selection kept is read off the output (:meth:`OkTopkReducer._in_global_set`).

Cost (data phases): ``alltoallv`` ``P-1`` rounds + ring all-gather ``P-1`` rounds (Table I:
``2(P + log P)``); bytes about ``4(P-1)/P k`` units, within Table I's ``[2(P-1)/P k, 6(P-1)/P k]``.
Sizes are data dependent: headers are paid (``alltoallv`` counts; ``allgatherv`` counts on steps
without a threshold re-evaluation). Re-evaluation steps add two small all-gathers (threshold) and
balancing steps one small ``allreduce``.
``stats["global_selected"]``: entries kept by the global selection (the output's support).
"""

from __future__ import annotations

import torch

from ..spardl.wire import pack, pair_bytes, unpack
from ..sparse import coalesce_in_order, set_at
from .base import Reducer
from .registry import register
from ..select.exact import topk_indices as select_topk

#: Balancing histogram (``_balance``): ``64 P`` bins of ``n / (64 P)`` indices. Region boundaries
#: snap to bin edges, so each region's share is off by at most one bin - about 1/64 (~1.6 %) of a
#: region's ``k / P`` when selected indices spread evenly within bins - for a histogram all-reduce
#: of ``64 P`` float64 (2 KiB at P = 4): one latency, negligible next to the data phases. Our choice,
#: not the paper's (the paper fixes only the period, every 64 steps: ``balance_every``).
_BINS_PER_RANK = 64
#: Threshold radix select (``_global_threshold``): 2^10 bins per level, i.e. 10 bits of the fp32
#: pattern per level (the shifts 21 and 11 there: bits 30..21, then 20..11). Two levels give the
#: exponent and 12 mantissa bits, a relative width of 2^-12 (``k`` to ``k`` + entries within 0.02 %),
#: with two all-gathers of 8 KiB per rank each (latency-bound); one level of 2^20 bins would move 8 MiB.
_TH_BINS = 1024
#: One-level threshold select (``_window_threshold``): ``2^13`` bins of ``2^11`` fp32 patterns (the
#: same relative width 2^-12 as two radix levels) centred on the previous threshold: one binade each
#: way (the k-th magnitude may halve or double between steps), one all-gather of 32 KiB of int32
#: counts per rank instead of two latency-bound ones; outside the window, the radix select runs.
_WIN_BINS, _WIN_SHIFT = 1 << 13, 11


def _bits(th: float) -> int:
    """The fp32 bit pattern of a non-negative threshold, as an int (``|v| >= th`` <=> ``key >= bits``)."""
    return int(torch.tensor([th], dtype=torch.float32).view(torch.int32)[0])


@register("oktopk")
class OkTopkReducer(Reducer):
    accepts_fold = True
    checks_input = True

    def __init__(self, comm, density=0.01, recompute_every=1, balance_every=64, **rest):
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
        recompute = self.th_global is None or self.step % self.recompute_every == 0
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx = select_topk(acc, k, self._scratch)
            vals = acc.index_select(0, idx)  # index_select/index_copy_: a third of [] indexing's time on CPU
            self.th_local = float(vals.abs().min()) if idx.numel() else 0.0
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
            ri, rv = coalesce_in_order([li[0] for li, _ in lists], [v[0] for _, v in lists], n)  # rank order
        keys = rv.abs().to(torch.float32).view(torch.int32)  # |v| orders like its fp32 bit pattern
        counts = None
        if recompute:
            with comm.phase("oktopk:threshold"), self.timed("comm"):
                self.th_global, counts = self._global_threshold(keys, k)
        with self.timed("select"):
            keep = torch.nonzero(keys >= _bits(self.th_global)).squeeze(1)
            gi, gv = ri.index_select(0, keep), rv.index_select(0, keep)
        with comm.phase("oktopk:allgather"), self.timed("comm"):
            bufs = self._allgather_kept(pack(gi, gv), counts, pb)
        with self.timed("select"):
            out = self.zeros_output(n, acc.dtype, acc.device)  # recycled: no page faults
            self.stats["global_selected"] = sum(x.numel() for x in bufs) // pb
            for x in bufs:
                fi, fv = unpack(x, 1, x.numel() // pb, acc.dtype)
                set_at(out, fi[0], fv[0])
            self.memory.keep(acc, idx[self._in_global_set(out, idx)])  # the rest stays (end-procedure)
        return out

    def _in_global_set(self, out: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Bool mask over this rank's selected ``idx``: which of them the global selection kept.

        With ``th_global > 0`` an index is kept iff its reduced value has ``|v| >= th_global > 0``,
        and only kept indices are written into the zero-filled ``out`` (regions are disjoint), so
        kept <=> ``out[i] != 0``: one gather of ``k`` entries of the output just written, no set
        test. (A reduced sum that overflowed to inf is kept and non-zero; NaN is never kept.) With
        ``th_global == 0`` (fewer than ``k`` entries in all regions) every entry was kept, zero sums too.
        """
        if not self.th_global:
            return torch.ones(idx.numel(), dtype=torch.bool, device=idx.device)
        return out.index_select(0, idx) != 0

    def _global_threshold(self, keys: torch.Tensor, k: int) -> tuple[float, list[int]]:
        """The ``k``-th largest reduced magnitude over all regions, to 12 bits, from two small
        all-gathers, and how many entries of every region pass it.

        A radix select across ranks on ``keys``, the fp32 bit patterns of ``|v|`` (non-negative
        floats order like their bit patterns as integers): a 1024-bin histogram of bits 30..21
        (exponent and two mantissa bits) summed over the ranks fixes the bin of the ``k``-th
        magnitude; a second 1024-bin histogram of bits 20..11 inside that bin fixes it to a relative
        width of ``2^-12``. The threshold is the lower edge of that sub-bin, so ``k`` to ``k`` +
        (entries within 0.02 % of the ``k``-th magnitude) pass. Every rank derives it from the same
        counts: identical everywhere. The histograms are all-gathered, not all-reduced: ``P - 1``
        ring rounds instead of ``2(P - 1)``, and since the threshold is a bin edge, every rank's
        count of ``keys >= threshold`` is read off the gathered rows - the final all-gather then
        needs no count exchange (:meth:`_allgather_kept`). Exact alternatives (gathering up to ``k``
        magnitudes from every region) cost ``(P-1) k`` values. After the first estimate one
        all-gather usually does (:meth:`_window_threshold`).
        """
        if self.th_global:
            found = self._window_threshold(keys, k, _bits(self.th_global))
            if found is not None:
                return found
        hi = torch.bitwise_right_shift(keys, 21)
        rows = self._gather_rows(torch.bincount(hi, minlength=_TH_BINS))  # [P, bins]: every rank's histogram
        from_top = torch.cumsum(rows.sum(0).flip(0), 0)  # from_top[i]: count in the top i + 1 bins
        if int(from_top[-1]) < k:
            return 0.0, rows.sum(1).tolist()  # fewer than k entries in all regions: keep them all
        i = int(torch.searchsorted(from_top, torch.tensor([k], dtype=from_top.dtype, device=from_top.device)))
        j1 = _TH_BINS - 1 - i
        sub = torch.bitwise_and(torch.bitwise_right_shift(keys[hi == j1], 11), _TH_BINS - 1)
        rows2 = self._gather_rows(torch.bincount(sub, minlength=_TH_BINS))
        from_top2 = torch.cumsum(rows2.sum(0).flip(0), 0) + (int(from_top[i - 1]) if i else 0)
        i2 = int(torch.searchsorted(from_top2, torch.tensor([k], dtype=from_top2.dtype, device=from_top2.device)))
        j2 = _TH_BINS - 1 - min(i2, _TH_BINS - 1)
        counts = rows[:, j1 + 1:].sum(1) + rows2[:, j2:].sum(1)  # per rank: bins above j1, sub-bins >= j2
        bits = torch.tensor([(j1 << 21) | (j2 << 11)], dtype=torch.int32)
        return float(bits.view(torch.float32)[0]), counts.tolist()

    def _window_threshold(self, keys: torch.Tensor, k: int, center: int) -> tuple[float, list[int]] | None:
        """:meth:`_global_threshold` from one all-gathered histogram: ``_WIN_BINS`` bins of
        ``2^_WIN_SHIFT`` bit patterns starting one binade below ``center`` (the previous threshold's
        pattern; the same on every rank), plus one bin for everything below and one for everything
        above the window. The bins are the radix select's level-2 cells, so the threshold is the
        same bit for bit. None (on every rank alike: they see the same counts) when the ``k``-th
        magnitude is not inside the window."""
        lo = max(0, (center >> _WIN_SHIFT << _WIN_SHIFT) - (_WIN_BINS << _WIN_SHIFT) // 2)  # cells as the radix's
        b = torch.bitwise_right_shift(keys - lo, _WIN_SHIFT).clamp_(-1, _WIN_BINS).add_(1)  # 0: below, W + 1: above
        rows = self._gather_rows(torch.bincount(b, minlength=_WIN_BINS + 2).to(torch.int32))
        from_top = torch.cumsum(rows.sum(0, dtype=torch.int64).flip(0), 0)  # from_top[i]: top i + 1 bins
        i = int(torch.searchsorted(from_top, torch.tensor([k], dtype=from_top.dtype, device=from_top.device)))
        if not 1 <= i <= _WIN_BINS:
            return None  # the k-th magnitude is above the window, below it, or there are fewer than k
        j = _WIN_BINS + 1 - i  # its bin, counting the below-bin as 0
        bits = torch.tensor([lo + ((j - 1) << _WIN_SHIFT)], dtype=torch.int32)
        return float(bits.view(torch.float32)[0]), rows[:, j:].sum(1, dtype=torch.int64).tolist()

    def _gather_rows(self, hist: torch.Tensor) -> torch.Tensor:
        """``[P, bins]``: every rank's histogram, in rank order (one ring all-gather)."""
        if self.comm.world_size == 1:
            return hist.view(1, -1)
        return torch.stack(self.comm.allgather(hist))

    def _allgather_kept(self, buf: torch.Tensor, counts: list[int] | None, pb: int) -> list[torch.Tensor]:
        """Every region's kept (index, value) pairs in rank order: with the ``counts`` known from the
        threshold step, one all-gather padded to the largest (no count round); else ``allgatherv``."""
        if self.comm.world_size == 1:
            return [buf]
        return self.comm.allgatherv(buf, None if counts is None else [c * pb for c in counts])

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

    def _check_extra_state(self, s, numel):
        """The partition must cut ``[0, numel)`` into this world's ``P`` ordered regions (a partition of
        another size would leave entries in no region); thresholds are finite magnitudes."""
        P, b = self.comm.world_size, s.get("bounds")
        if b is not None and not (isinstance(b, (list, tuple)) and len(b) == P + 1
                                  and all(isinstance(x, int) and not isinstance(x, bool) for x in b)
                                  and b[0] == 0 and b[-1] == numel and all(x <= y for x, y in zip(b, b[1:]))):
            raise ValueError(f"oktopk reducer state: bounds {b!r} are not {P} ordered regions of [0, {numel})")
        for key in ("th_local", "th_global"):
            th = s.get(key)
            bad = isinstance(th, bool) or not isinstance(th, (int, float)) or not 0 <= th < float("inf")
            if th is not None and bad:
                raise ValueError(f"oktopk reducer state: {key} must be a finite magnitude >= 0, got {th!r}")

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, counts=None, recompute_every=1, **_):
        """This code's ledger on a step without re-balancing, maximum over ranks: ``2(P-1)`` rounds
        (``alltoallv`` + ring all-gather), plus, on a threshold step (every step with the default
        ``recompute_every=1``), one ring all-gather of ``_WIN_BINS + 2`` int32 counts (``P-1`` rounds,
        ``(P-1) 4 (_WIN_BINS + 2)`` bytes: the usual case, the k-th magnitude within a binade of the
        previous threshold; the first estimate and misses add two all-gathers of ``_TH_BINS`` int64
        counts, ``2(P-1)`` rounds and ``2 (P-1) 8 _TH_BINS`` bytes). Data bytes
        depend on where the selected indices fall, so they are bounds, from the per-rank selected
        ``counts`` (default ``k`` each): the ``alltoallv`` brings at most every other rank's selection
        (``sum - min``), the all-gather at most ``P-1`` region lists of at most ``sum`` entries.
        Balancing steps add one small all-reduce. The paper's Table I figures are :meth:`table_cost`."""
        if P <= 1:
            return {"rounds": 0, "bytes_received": 0}
        c = [k] * P if counts is None else [int(x) for x in counts]
        pb = index_bytes + value_bytes
        rounds, extra = 2 * (P - 1), 0
        if int(recompute_every) == 1:
            rounds += P - 1
            extra = (P - 1) * 4 * (_WIN_BINS + 2)
        return {"rounds": rounds, "bytes_received": (extra, extra + (sum(c) - min(c) + (P - 1) * sum(c)) * pb)}

    @staticmethod
    def table_cost(P, k):
        """Table I: ``2(P + log2 P)`` rounds, ``[2, 6](P-1)/P k`` units (a COO pair = 2 units)."""
        lg = (P - 1).bit_length()
        return {"rounds": 2 * (P + lg), "units": (2 * (P - 1) / P * k, 6 * (P - 1) / P * k)}
