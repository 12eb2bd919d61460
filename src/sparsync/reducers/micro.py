"""``micro``: MiCRO - partitioned exclusive threshold selection with threshold scaling.

Yoon & Oh, "MiCRO: Near-Zero Cost Gradient Sparsification for Scaling and Accelerating Distributed
DNN Training", Algorithm 1. The flat gradient is cut into ``P`` contiguous partitions; at
step ``t`` rank ``r`` owns partition ``(t mod P + r) mod P``. Each rank

1. accumulates ``acc = grad + residual`` (local error feedback, :mod:`.memory`),
2. selects ``idx_r = {j in own partition : |acc[j]| >= delta_t}`` (at most
   ``ceil(cap_factor * k / P)``, the largest kept) - partitions are disjoint, so the union has no
   duplicates,
3. all-gathers the index lists and concatenates them in partition order: the sorted union ``idx_t``,
   the same on every rank (default rule: one padded all-gather, optionally as 16-bit block offsets,
   :func:`sparsync.blockindex.gather_block16`),
4. sums ``acc[idx_t]`` over ranks (``values``: ``"owner"`` - each union slice summed in rank order
   by its owner and sent back; ``"gather"`` - every rank sums every contribution in rank order;
   ``"allreduce"`` - the paper's dense all-reduce of the values; ``value_bits`` 2 / 4 / 8: ``"gather"`` of
   each rank's values as codes with a per-tensor table, SparseLoCo's format, :mod:`sparsync.select.quantise`),
5. keeps ``acc`` with ``idx_t`` cleared as its residual (conserving; half-precision and coded values keep
   their rounding error there too, except on the ``"allreduce"`` path), and
6. chooses the next threshold: by default (``rule="histogram"``) calibrated every step from one
   all-gather of per-rank counts at ``bins + 1`` candidate thresholds
   (:class:`sparsync.select.calibration.ThresholdWindow`); ``"adaptive"`` / ``"proportional"`` /
   ``"micro"`` (the authors' rule) are the communication-free rules of
   :class:`sparsync.select.threshold.ThresholdController` fed with the global ``K_t``.

The output is :class:`~.base.IndexedSum` (``idx_t`` and the summed values), bitwise the same on every
rank. Cost per rank: :meth:`MicroReducer.predicted_cost` (equal to the ledger; ``m`` = the largest
per-rank count, ``K`` = the union's size)::

    rounds = (P - 1) [histogram]  +  (P - 1) [start="data", steps 0-1]  +  (P - 1) [indices, m > 0]
             +  (2 (P - 1) [values="owner", "allreduce"]  |  (P - 1) [values="gather"])  [K > 0]

Options, the threshold rule's reasoning, the byte formula and measurements: ``docs/micro.md``.
``stats``: ``selected`` (``K_t``), ``local_selected``, ``passed`` (before the cap), ``saturated``,
``threshold``, ``next_threshold``, ``partition``, ``max_count``, ``spread``, ``candidates`` and the
times ``select_s``, ``comm_s`` (``comm_calibrate_s``, ``comm_indices_s``, ``comm_values_s``), ``update_s``.
"""

from __future__ import annotations

import math

import torch

from ..blockindex import block16_bytes, block16_pays, block_count, gather_block16
from ..comm import gather_padded
from ..select.quantise import check_value_bits, decode_values, encode_values
from ..select.calibration import ThresholdWindow
from ..select.threshold import (
    ThresholdController,
    Workspace,
    check_threshold,
    choose_edge,
    initial_threshold,
    keep_largest,
    local_histogram,
    owned_partition,
    partition_bounds,
    partition_owner,
    partitioned_threshold_select,
    threshold_indices,
)
from ..sparse import index_dtype_for, sum_in_rank_order
from .base import IndexedSum, Reducer
from .capabilities import OptionFact, wire_conserves
from .memory import decay_memory
from .registry import register

#: a density change between steps by more than this factor restarts the threshold window
#: (:meth:`MicroReducer._follow_target`)
RESTART_FACTOR = 2.0


def value_path(values: str, P: int) -> str:
    """``values="auto"`` -> ``"gather"`` for ``P <= 2`` (the same bytes as the owner path, one round
    fewer), ``"owner"`` beyond (``(P - 1) / 2`` times fewer value bytes); any other choice as given."""
    if values == "auto":
        return "gather" if P <= 2 else "owner"
    return values


def check_cap_factor(cap_factor):
    if cap_factor is None:
        return None
    try:
        c = float(cap_factor)
    except (TypeError, ValueError):
        raise ValueError(f"cap_factor must be a number >= 1 or None, got {cap_factor!r}") from None
    if not (c >= 1.0) or not math.isfinite(c):
        raise ValueError(f"cap_factor must be a finite number >= 1 or None, got {cap_factor!r}")
    return c


@register("micro")
class MicroReducer(Reducer):
    accepts_fold = True  # the memory accumulates in place (reuse_buffers): a policy may fold into it
    checks_input = True  # the memory's add checks the input in its pass
    supports_value_dtype = True
    #: "owner" / "gather" keep every rounding; "allreduce" does not (then ``conserving`` is False with fp16/bf16)
    value_dtype_conserving = OptionFact(True, lambda r: r.values != "allreduce")
    reuse_buffers = OptionFact(True, lambda r: r._reuse_buffers)  # the option of that name
    indexed_output = True  # _reduce returns an IndexedSum (base.reduce densifies unless asked not to)
    #: ``ef_decay`` below 1 sheds the residual's mass by design (SparseLoCo's error feedback)
    conserving = OptionFact(True, lambda r: r.ef_decay == 1.0 and not r.packed and wire_conserves(r))

    def __init__(self, comm, density: float = 0.01, threshold: float | None = None,
                 rule: str = "histogram", spread: float = 1.1, max_spread: float = 4.0, bins: int = 128,
                 gamma: float = 0.5, max_step: float = 2.0, band: float = 0.02, min_step: float = 1e-3,
                 grow: float = 1.5, shrink: float = 0.5, cap_factor: float | None = 4.0,
                 force_nonempty: bool = False, reuse_buffers: bool = True, gather: str = "direct",
                 values: str = "auto", start: str = "data", lead: float = 0.7, indices: str = "auto",
                 ef_decay: float = 1.0, value_bits: int | None = None, **rest):
        if values not in ("auto", "owner", "gather", "allreduce"):
            raise ValueError(f"micro: values must be 'auto', 'owner', 'gather' or 'allreduce', got {values!r}")
        if value_bits is not None:  # as topka's: value_bits decides over value_dtype
            value_bits = check_value_bits(value_bits, "micro")
            rest["value_dtype"] = "fp16" if value_bits == 16 else "fp32"
        self.value_bits, self.packed = value_bits, value_bits is not None and value_bits < 16
        if self.packed and values not in ("auto", "gather"):
            raise ValueError(f"micro: value_bits={value_bits} needs values='gather' (or 'auto'), got {values!r}")
        self.values = values = "gather" if self.packed else value_path(values, comm.world_size)
        self._reuse_buffers = bool(reuse_buffers)  # read by Reducer.__init__ (the memory's form)
        super().__init__(comm, density=density, **rest)
        self.ef_decay = decay_memory(self.memory, ef_decay, self.name)
        self.threshold0 = None if threshold is None else check_threshold(threshold)
        rules = ("histogram",) + ThresholdController.RULES
        if rule not in rules:
            raise ValueError(f"micro: rule must be one of {', '.join(rules)}, got {rule!r}")
        # validate every hyperparameter now (target and delta are set on the first step)
        self.rule_options = {"rule": rule, "gamma": float(gamma), "max_step": float(max_step),
                             "band": float(band), "min_step": float(min_step), "grow": float(grow),
                             "shrink": float(shrink)}
        ThresholdController(1, 1.0, **self._controller_options())
        self.window = ThresholdWindow(spread, max_spread, bins, lead)  # the histogram rule's candidates
        self.cap_factor = check_cap_factor(cap_factor)
        self.force_nonempty = bool(force_nonempty)
        if gather not in ("direct", "ring"):
            raise ValueError(f"micro: gather must be 'direct' or 'ring', got {gather!r}")
        self.gather = gather
        if indices not in ("auto", "block16", "plain"):
            raise ValueError(f"micro: indices must be 'auto', 'block16' or 'plain', got {indices!r}")
        if indices == "auto":  # block16 where the caller chose bytes over CPU (half or coded values)
            indices = "plain" if self.wire_dtype is None and not self.packed else "block16"
        self.indices = indices
        if start not in ("data", "guess"):
            raise ValueError(f"micro: start must be 'data' or 'guess', got {start!r}")
        self.start = start
        self.controller: ThresholdController | None = None
        self._ws = Workspace()
        self._bounds: list[tuple[int, int]] | None = None

    # ------------------------------------------------------------------ state
    def _extra_state(self) -> dict:
        return {"controller": None if self.controller is None else self.controller.state_dict(),
                **self.window.state_dict()}

    def _load_extra_state(self, d: dict) -> None:
        self._bounds = None
        self.window.load_state_dict(d)
        c = d.get("controller")
        if c is None:
            self.controller = None
        else:
            self.controller = ThresholdController(c["target"], c["delta"], **self._controller_options())
            self.controller.load_state_dict(c)

    # ------------------------------------------------------------------ the step
    def _setup(self):
        P = self.comm.world_size
        self._bounds = partition_bounds(self.numel, P)
        if self.controller is None:
            k = self.k
            d0 = self.threshold0 if self.threshold0 is not None else initial_threshold(k)
            self.controller = ThresholdController(k, d0, **self._controller_options())
            if self.threshold0 is None:  # delta_0 is a data-blind guess: the widest window first,
                self.window.start_blind(data=self.start == "data")  # or centred on sampled data

    def _controller_options(self) -> dict:
        """The histogram rule keeps its window centre in a controller (unused rule "adaptive")."""
        o = dict(self.rule_options)
        if o["rule"] == "histogram":
            o["rule"] = "adaptive"
        return o

    def _follow_target(self, k: int) -> None:
        """The controller follows a density changed between steps (warm-up schedules). A jump of
        more than :data:`RESTART_FACTOR` (a dense warm-up ending: density 1 -> 0.2) restarts the
        window as at the first step (``start="data"``: centred on sampled estimates at the new
        target), where the trend-following window would need one step per factor ``max_spread``
        from the dense phase's near-zero threshold, sending up to ``cap_factor`` x k meanwhile."""
        c = self.controller
        if (k > RESTART_FACTOR * c.target or RESTART_FACTOR * k < c.target) \
                and self.rule_options["rule"] == "histogram":
            self.window.start_blind(data=self.start == "data")
        c.target = k

    def _counts_at(self, passed: list[int], step: int) -> list[int]:
        """Every rank's transmitted count from its count above the chosen threshold (cap, force)."""
        P, out = self.comm.world_size, []
        for r, c in enumerate(passed):
            s, e = self._bounds[owned_partition(r, step, P)]
            cap = self._cap(e - s)
            c = int(c) if cap is None else min(int(c), cap)
            if self.force_nonempty and c == 0 and e > s:
                c = 1
            out.append(c)
        return out

    def _allgather_fixed(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same numel everywhere), in rank order.

        ``gather="direct"``: one batch of ``P - 1`` sends and receives of known size
        (``comm.allgather_direct``), recorded exactly like a ring all-gather (``P - 1`` rounds, messages and
        ``(P - 1) * nbytes`` each way), but all messages are in flight at once, where each step of
        a ring needs every process scheduled (``docs/micro.md``, "Direct all-gathers").
        ``"ring"``: ``comm.allgather``.
        """
        if self.gather == "ring" or self.comm.world_size == 1:
            return self.comm.allgather(t)
        return self.comm.allgather_direct(t)

    def _owner_sum(self, sent: torch.Tensor, sizes: list[int], step: int,
                   dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sum over ranks of ``sent``, this owner's rounding error or None).

        ``sent``: every rank's values at the union, in partition order. Two direct batches
        (``values="owner"``): rank ``r`` sends the slice at rank ``q``'s indices to ``q``; ``q`` adds
        the ``P`` slices in rank order in ``dtype`` (fp32) and sends the sum to every rank. Every
        sum is computed once, by its owner, so all ranks hold the same bits. With half-precision
        values (``value_dtype``) the sums travel in half precision too, and the owner returns
        their rounding error, ``total - float(half(total))`` (exact in fp32), for its residual at
        its own indices: nothing is lost, and the sums cost half the bytes.
        """
        comm = self.comm
        P, me = comm.world_size, comm.rank
        pieces = torch.split(sent, sizes)  # partition order
        piece = [pieces[owned_partition(q, step, P)] for q in range(P)]  # by owner rank
        peers = [(me + d) % P for d in range(1, P)]
        mine = piece[me]
        got = comm.exchange([(q, (piece[q], "fixed")) for q in peers],
                            [(p, (mine.numel(), sent.dtype)) for p in peers]) if P > 1 else {}
        got[me] = mine
        total = sum_in_rank_order([got[p] for p in range(P)], mine.numel(), dtype, mine.device)
        wire, err = total, None
        if sent.dtype != dtype:  # half values: the sums go back rounded, the owner keeps the error
            wire = self.wire_values(total)
            err = total - wire.to(dtype)
        sums = comm.exchange([(q, (wire, "fixed")) for q in peers],
                             [(q, (piece[q].numel(), wire.dtype)) for q in peers]) if P > 1 else {}
        sums[me] = wire
        return torch.cat([sums[partition_owner(p, step, P)] for p in range(P)]).to(dtype), err

    def _gathered_sum(self, sent: torch.Tensor, dtype) -> torch.Tensor:
        """(``values="gather"``) the sum over ranks of ``sent`` (every rank's values at the union):
        one all-gather of the contributions (:meth:`_allgather_fixed`: every rank's ``K`` is the
        same), added in rank order in ``dtype`` on every rank - the same bits everywhere."""
        return sum_in_rank_order(self._allgather_fixed(sent), sent.numel(), dtype, sent.device)

    def _coded_sum(self, vals: torch.Tensor, union: torch.Tensor, dtype) -> torch.Tensor:
        """(``value_bits`` < 16) :meth:`_gathered_sum` of the ranks' values coded (``encode_values``); the
        residual at ``union`` (cleared by ``memory.take``) keeps ``vals`` minus their decode."""
        msg, dec = encode_values(vals, self.value_bits)
        self.memory.put_back(union, vals - dec)
        parts = [decode_values(m, vals.numel(), self.value_bits) for m in self._allgather_fixed(msg)]
        return sum_in_rank_order(parts, vals.numel(), dtype, vals.device)

    def _cap(self, size: int) -> int | None:
        if self.cap_factor is None:
            return None
        return min(size, max(1, math.ceil(self.cap_factor * self.controller.target / self.comm.world_size)))

    def _gather_indices(self, idx: torch.Tensor, known: list[int] | None, step: int) -> list[torch.Tensor]:
        """Every rank's selected indices in rank order: ``allgatherv`` on the narrowest index dtype,
        or, when the calibration told every rank all counts (``known``), one all-gather padded to the
        largest count (no count round) - as 16-bit offsets within 65536-entry blocks of the sender's
        partition when that is smaller (``indices="block16"``, :mod:`sparsync.blockindex`)."""
        comm = self.comm
        with comm.phase(self.name + ".indices"):
            if known is None:
                return comm.allgatherv(idx.to(index_dtype_for(self.numel)))
            nb = self._index_blocks()
            if nb is None or not block16_pays(max(known), nb, index_dtype_for(self.numel).itemsize):
                return gather_padded(idx.to(index_dtype_for(self.numel)), known, self._allgather_fixed)
            P = comm.world_size
            starts = [self._bounds[owned_partition(r, step, P)][0] for r in range(P)]
            return gather_block16(idx, known, starts, comm.rank, nb,
                                  lambda msg, sizes: gather_padded(msg, sizes, self._allgather_fixed))

    def _index_blocks(self) -> int | None:
        """Blocks per partition for ``indices="block16"`` (None: plain indices)."""
        if self.indices != "block16" or self.comm.world_size == 1:
            return None
        return block_count(max(e - s for s, e in self._bounds))

    def _window_from_estimates(self, estimate: float) -> float:
        """Steps 0 and 1 (``start="data"``): one all-gather of the ``P`` local estimates (8 bytes each)
        gives every rank the same window (:meth:`ThresholdWindow.center_from_estimates`)."""
        with self.timed("comm"), self.timed("comm_calibrate"), self.comm.phase(self.name + ".window"):
            mine = torch.tensor([estimate], dtype=torch.float64, device=self.comm.device)
            ests = torch.cat(self._allgather_fixed(mine)).tolist()
        return self.window.center_from_estimates(ests, self.controller.delta)

    def _reduce(self, grad):
        if self._bounds is None or self.controller is None:
            self._setup()
        self._follow_target(self.k)
        comm, P, step = self.comm, self.comm.world_size, self.step
        part = owned_partition(comm.rank, step, P)
        start, end = self._bounds[part]
        cap = self._cap(end - start)
        calibrate = self.rule_options["rule"] == "histogram"
        window, center, estimate = self.window, self.controller.delta, None
        with self.timed("select"):
            acc = self.memory.add(grad)
            if calibrate and window.take_data_window():
                estimate = window.local_estimate(acc, start, end, self.controller.target, P, comm.rank)
        if calibrate:  # the estimates' all-gather is timed as comm
            center = window.center(center) if estimate is None else self._window_from_estimates(estimate)
        with self.timed("select"):
            if calibrate:
                edges = window.edges(center, acc.dtype, acc.device)
                cand = threshold_indices(acc[start:end], float(edges[0]), workspace=self._ws, offset=start)
                absv = acc.index_select(0, cand).abs_()  # index_select: ~3x cheaper than [] on CPU
                hist, bucket = local_histogram(absv, edges)
            else:
                delta = center
                idx, passed = partitioned_threshold_select(acc, delta, start, end, cap=cap, workspace=self._ws)
        known = None  # every rank's count, when the calibration told us (no count exchange needed)
        if calibrate:
            with self.timed("comm"), self.timed("comm_calibrate"), comm.phase(self.name + ".calibrate"):
                hists = torch.stack(self._allgather_fixed(hist))  # (P, bins + 2): tiny, latency bound
            j, _ = choose_edge(hists.sum(0), self.controller.target)
            delta = float(edges[j])
            known = self._counts_at(hists[:, j + 1:].sum(1).tolist(), step)
            with self.timed("select"):
                keep = bucket > j  # bucket >= j + 1  <=>  |acc| >= edges[j]
                idx = cand[keep]
                passed = idx.numel()
                if cap is not None and passed > cap:
                    idx = keep_largest(idx, absv[keep], cap)
        if self.force_nonempty and idx.numel() == 0 and end > start:
            idx = torch.tensor([start + step % (end - start)], dtype=torch.int64, device=acc.device)
        with self.timed("comm"):
            with self.timed("comm_indices"):
                lists = self._gather_indices(idx, known, step)
            counts = [x.numel() for x in lists]
            # partition order = globally sorted union, the same on every rank
            union = torch.cat([lists[partition_owner(p, step, P)] for p in range(P)]).to(torch.int64)
            K = union.numel()
            sum_err = None
            if K:
                with self.timed("comm_values"), comm.phase(self.name + ".values"):
                    # the values to send, and the residual keeps acc - sent there (half values: their
                    # rounding error), in one visit (memory.take; the union is ascending)
                    mine, sent = self.memory.take(acc, union)
                    if self.values == "allreduce":
                        # the all-reduce of the values already rounded (wire_values leaves them as they are)
                        vals = self.allreduce_wire_values(sent)[1].to(acc.dtype)
                    elif self.packed:
                        vals = self._coded_sum(mine, union, acc.dtype)
                    elif self.values == "gather":
                        vals = self._gathered_sum(sent, acc.dtype)
                    else:
                        vals, sum_err = self._owner_sum(
                            sent, [lists[partition_owner(p, step, P)].numel() for p in range(P)], step,
                            acc.dtype)
        with self.timed("update"):
            if K:  # memory.take left acc - sent in the residual
                if sum_err is not None:  # and the owner keeps its half sums' rounding error
                    self.memory.put_back(lists[comm.rank], sum_err)
            else:
                vals = acc.new_zeros(0)
                self.memory.keep(acc)  # nothing sent
            out = IndexedSum(union, vals, self.numel)
        if calibrate:  # next window: centred on the threshold chosen now; wider if it hit an end
            window.chose(delta, j)
            # a window whose lowest edge passed (density 1: everything sent) may give 0; the next window
            # needs a positive centre (as the controller's own update keeps it)
            self.controller.delta = next_delta = max(delta, 1e-30)
        else:
            # The controller sees the transmitted K even when a rank hit its budget: a structurally
            # dense partition must not push the global threshold up (that would starve the others).
            next_delta = self.controller.update(K)
        self.last_indices, self.last_union = idx, union
        self.stats.update(selected=K, local_selected=int(idx.numel()), passed=int(passed),
                          threshold=delta, next_threshold=next_delta, partition=part,
                          saturated=cap is not None and passed > cap, max_count=max(counts),
                          spread=window.spread_now, candidates=int(cand.numel()) if calibrate else None)
        return out

    # ------------------------------------------------------------------ cost
    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, counts=None, rule="histogram", bins=128,
                       values="auto", rank=None, data_window=False, indices="auto", value_bits=None, **_):
        """Cost per rank: MiCRO's index all-gather and value sum, plus the calibration all-gather of the
        default rule. ``data_window``: the step also all-gathers the 8-byte threshold estimates
        (``start="data"``: steps 0 and 1). With ``m_r`` = rank ``r``'s count, ``m = max_r m_r``,
        ``K = sum_r m_r``, ``vb`` = ``value_bytes``, ``nb = ceil(ceil(n/P) / 65536)``::

            bytes_received = (P - 1) (bins + 2) 8 [histogram]  +  (P - 1) 8 [data_window]
                + (P - 1) 2 (2 nb + m)  [histogram rule, block16 indices, when < m index_bytes]
                  | (P - 1) m index_bytes                             [otherwise]
                + (P - 1) m_r vb + (K - m_r) vb  [values="owner"]  |  (P - 1) K vb  [values="gather"]
                  | 2 (P - 1) K vb // P  [values="allreduce"]
                  | (P - 1) (ceil(K b / 8) + 4 * 2^b)  [value_bits b < 16: "gather", block16 under "auto"]

        (rounds: the module docstring). With the per-rank ``counts`` of a step the result is exact -
        for ``rank`` (the owner path receives by rank), or the largest over ranks when ``rank`` is
        None; otherwise it is for ``K = k`` with the bounds ``m in [ceil(k/P), k]`` as a
        ``(low, high)`` pair (owner path: for the rank that sends the most indices).
        """
        if P <= 1:
            return {"rounds": 0, "bytes_received": 0}
        cal_rounds = P - 1 if rule == "histogram" else 0
        cal_bytes = (P - 1) * (int(bins) + 2) * 8 if rule == "histogram" else 0
        if data_window and rule == "histogram":
            cal_rounds, cal_bytes = cal_rounds + P - 1, cal_bytes + (P - 1) * 8
        packed = value_bits is not None and value_bits < 16
        if value_bits is not None and not packed:
            value_bytes = value_bits // 8
        values = "gather" if packed else value_path(values, P)
        value_rounds = P - 1 if values == "gather" else 2 * (P - 1)
        if indices == "auto":
            indices = "block16" if value_bytes < 4 or packed else "plain"
        nb = block_count(-(-n // P)) if indices == "block16" and rule == "histogram" else None

        def index_bytes_at(m):  # one padded message per peer
            if nb is not None and block16_pays(m, nb, index_bytes):
                return (P - 1) * block16_bytes(m, nb)
            return (P - 1) * m * index_bytes

        def value_bytes_at(K, m_r):  # owner: contributions in, sums out, both as value_bytes
            if packed:
                return (P - 1) * (-(-K * value_bits // 8) + 4 * (1 << value_bits))
            if values == "owner":
                return (P - 1) * m_r * value_bytes + (K - m_r) * value_bytes
            if values == "gather":
                return (P - 1) * K * value_bytes
            return 2 * (P - 1) * K * value_bytes // P

        if counts is not None:
            K, m = sum(counts), max(counts)
            rounds = cal_rounds + (P - 1 if m else 0) + (value_rounds if K else 0)
            ranks = range(P) if rank is None else [rank]
            vb = max(value_bytes_at(K, counts[r]) for r in ranks)
            return {"rounds": rounds, "bytes_received": cal_bytes + index_bytes_at(m) + vb}
        lo_m, hi_m = math.ceil(k / P), k
        lo = cal_bytes + index_bytes_at(lo_m) + value_bytes_at(k, lo_m)
        hi = cal_bytes + index_bytes_at(hi_m) + value_bytes_at(k, hi_m)
        return {"rounds": cal_rounds + (P - 1) + value_rounds, "bytes_received": (lo, hi)}
