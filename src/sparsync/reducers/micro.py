"""``micro``: MiCRO - partitioned exclusive threshold selection with threshold scaling.

What (``spec/micro.md`` §2-§6, Algorithm 1): the flat gradient is split into ``P`` contiguous
partitions; at step ``t`` rank ``r`` owns partition ``(t mod P + r) mod P``. Each rank

1. accumulates ``acc = grad + residual`` (local error feedback),
2. selects ``idx_r = {j in own partition : |acc[j]| >= delta_t}`` - only ``n/P`` entries are read,
   and partitions are disjoint, so the union has no duplicates ("no gradient build-up"),
3. all-gathers the index lists (default rule: sizes known from the calibration, one padded
   all-gather by direct sends, see ``gather``; feedback rules: ``comm.allgatherv``), and
   concatenates them in *partition* order, which is the globally sorted union ``idx_t`` on every
   rank,
4. sums ``acc[idx_t]`` over ranks - every rank contributes at every selected index, including
   those chosen by other ranks. Default for ``P > 2`` (``values="owner"``): each rank sends the values at rank
   ``q``'s indices to ``q``, the owner sums them in rank order and sends the sums back - a
   reduce-scatter + all-gather along the partitions in two direct batches (2 dependent rounds
   instead of the ring all-reduce's ``2(P - 1)``, the same bytes; see ``values`` below);
   ``values="gather"``: every rank sends its values at the whole union to every peer (one direct
   batch: one dependent round instead of two, ``(P - 1) K`` values received instead of ``~2K``) and
   every rank adds the ``P`` contributions in rank order itself (the default for ``P <= 2``);
   ``values="allreduce"``: one dense all-reduce of the ``K_t`` values (the paper's wording),
5. zeroes ``acc[idx_t]`` and keeps the rest as residual (conserving), and
6. scales the threshold for the next step.

Why: selection cost ``O(n/P)`` with a streaming kernel instead of an ``O(n)`` top-k, and a
communication volume that tracks the target ``k = density * n`` (global: summed over ranks).

Threshold rule (option ``rule``; ``spec/micro.md`` §5 leaves it open, see ``docs/micro.md``):

* ``"histogram"`` (default) - per-step calibration. The threshold of the last step is the centre
  of a window of ``bins + 1`` log-spaced candidate thresholds ``center * s ** (2j/bins - 1)``. Each
  rank finds the entries of its partition above the lowest one (the same streaming kernel), counts
  them per bin, and ONE all-gather of the ``bins + 2`` counts (1 KiB per rank, latency-bound; sent
  directly to every peer, see ``gather``)
  gives every rank the global count at every candidate; all pick the same threshold - the one
  whose global count is closest to ``k`` - and filter their candidates. Since every rank then
  knows every rank's count, the index all-gather needs no count exchange (one padded
  all-gather), so the rule costs ``P - 1`` extra latency-bound rounds in all. The window spread ``s`` starts at
  ``spread`` (1.1), squares (up to ``max_spread``) whenever the choice hits an end of the window
  and shrinks back otherwise, so a threshold that is 1000x off is found in ~10 steps. The window
  is centred ahead of the last threshold by the last step's trend (option ``lead``), and the first
  two windows on a sampled estimate from the data (option ``start``; see ``_window_center``).
  Measured: within +-1% of the target every step on the digits-MLP and drifting heavy-tailed streams.
  Why not the pure feedback rule: with error feedback the count reacts to a threshold change
  ~``1/density`` times more steeply right after it than in steady state, so a rule that only sees
  last step's count is either slow or oscillates (``ThresholdController`` docstring); and the
  per-step count of an SGD stream fluctuates by ~25% with the batch gradient norm.
* ``"adaptive"`` / ``"proportional"`` / ``"micro"`` - communication-free feedback rules of
  :class:`~sparsync.select.threshold.ThresholdController` fed with the global ``K_t`` (known to
  every rank after step 3, so ``delta`` stays identical everywhere); ``"micro"`` is the authors'
  x1.005 / x1.00125 / x0.995 rule, for reproduction.

Cost (per rank ``r``, ``m = max_r |idx_r|`` index elements, ``m_r = |idx_r|``, ``K = sum_r |idx_r|``,
``value_bytes`` on the wire - the contributions and, on the owner path, the sums; ``nb`` =
``ceil(ceil(n/P) / 65536)`` blocks per partition)::

    rounds         = (P - 1) [histogram rule]  +  (P - 1) [start="data", steps 0-1]  +  (P - 1)
                     +  2 (P - 1) [values="owner", "allreduce"]  |  (P - 1) [values="gather"]
    bytes_received = (P - 1) (bins + 2) 8 [histogram rule]  +  (P - 1) 8 [start="data", steps 0-1]
                     +  (P - 1) * 2 (2 nb + m)    [histogram rule, block16 indices, when < m * index_bytes]
                     |  (P - 1) * m * index_bytes [otherwise]
                     + (P - 1) * m_r * value_bytes + (K - m_r) * value_bytes   [values="owner"]
                     + (P - 1) * K * value_bytes                              [values="gather"]
                     + 2 (P - 1) * K * value_bytes // P                       [values="allreduce"]

(the ledger counts a batch of ``P - 1`` direct messages as ``P - 1`` rounds, like a ring step
each; on the wire the owner path is two dependent batches where the ring all-reduce is
``2(P - 1)`` dependent steps - each of which, with more ranks than cores, waits for the next
process to be scheduled: measured in docs/benchmarks.md, issue 10).

plus, for the feedback rules only, ``P - 1`` 8-byte count headers (``allgatherv``). With a
calibrated threshold ``K ~= k`` and ``m ~= k/P`` (:meth:`MicroReducer.predicted_cost` gives the
bounds ``ceil(k/P) <= m <= k``). When ``K = 0`` no value all-reduce is issued (every rank knows
``K``); when ``m = 0`` no index all-gather either.

Other options (``make_reducer("micro", comm, density, ...)``):

* ``threshold`` - initial ``delta_0`` (default ``1/(2 sqrt(k))``, ``spec/micro.md`` §5).
* ``spread``, ``max_spread``, ``bins``, ``lead`` (0..1, default 0.7: how far the window's centre
  follows the last step's threshold ratio; 0 = centred on the last threshold), ``start``
  (``"data"``, default: the first two windows are centred on a sampled estimate, one 8-byte
  all-gather each; ``"guess"``: the widest window around ``delta_0``) - histogram rule;
  ``gamma``, ``max_step``, ``band``, ``min_step``, ``grow``, ``shrink`` (feedback rules, see
  ``ThresholdController``).
* ``cap_factor`` - per-partition budget: a rank sends at most ``ceil(cap_factor * k / P)`` indices
  (default 4; the largest-magnitude ones among those that passed, the rest stay in the residual).
  It bounds the message when the threshold is far too low (e.g. the first steps). ``None``: no cap.
* ``force_nonempty`` - mimic the reference snapshot: a rank that selects nothing sends index
  ``start + (t mod size)`` of its partition (default False: empty selections are allowed).
* ``reuse_buffers`` - accumulate in place (default True): ``acc`` is the residual tensor itself,
  ``residual += grad`` (:class:`BufferedAccumulator`), instead of a fresh allocation (a fresh 40 MB
  tensor costs ~7 ms of page faults at n = 1e7 on this machine). The residual tensor of step ``t``
  is therefore overwritten at step ``t + 1``: clone it if you keep it. It also
  recycles the dense output (:meth:`Reducer.zeros_output`): a buffer is reused only after the
  caller has dropped every reference to it (views included) and is zeroed in full, so outputs the
  caller keeps are never touched (a fresh 40 MB output cost ~7 ms per rank per step, ~15-25 ms
  with 4 ranks on 2 cores).
* ``values`` - how the selected values are summed: ``"owner"``, ``"gather"`` or ``"allreduce"``
  (see step 4); ``"auto"`` (default): ``"gather"`` for ``P <= 2`` (there it receives the same ``K``
  values as the owner path, in one round instead of two, and no sum is rounded), ``"owner"``
  beyond. The owner adds the ``P`` contributions in rank order in fp32 and sends the sums, so
  every rank holds the same bits. With ``value_dtype`` fp16/bf16 both the contributions and the
  sums travel in half precision, and every rounding error stays in a residual - each rank's
  contribution's in its own, each sum's in its owner's (at the owner's own indices, where it is
  sent again once it has grown) - so the path is conserving at half the value bytes. The
  all-reduce sums half-precision values on the wire (not conserving then). ``"gather"`` trades
  bytes for latency: one batch of direct messages instead of the owner path's two dependent ones,
  at ``(P - 1) / 2`` times the owner path's value bytes (1.5x at P = 4); every rank sums the same
  ``P`` contributions in the same order, so all hold the same bits, and only the contributions are
  rounded to ``value_dtype`` (each rank keeps its own rounding error): conserving.
* ``indices`` - how the padded index all-gather of the default rule encodes the indices:
  ``"block16"`` as 16-bit offsets within 65536-entry blocks of the sender's partition plus one
  int32 count per block (:mod:`sparsync.blockindex`; used when it is smaller than ``index_bytes``
  per index, i.e. from ``2 nb`` indices on: half the index bytes), ``"plain"`` int32 (int64 beyond
  ``2^31`` entries), ``"auto"`` (default) block16 with ``value_dtype`` fp16/bf16, plain with fp32.
  The result is bitwise the same. Why "auto": the codec costs ~0.4 ms more CPU per call at 25k
  indices per rank (P = 4), and on the CPU-bound emulated cluster at 1 Gbit/s that made the fp32
  reduce of issue 11 4-8 % slower; a caller who sends half values has chosen bytes over CPU.
* ``gather`` - how the fixed-size all-gathers of the default rule (histogram counts, padded index
  lists, and the contributions of ``values="gather"``) travel: ``"direct"`` (default) posts the
  ``P - 1`` sends and receives at once (``comm.allgather_direct``); ``"ring"`` uses
  ``comm.allgather`` (gloo's ring: ``P - 1`` dependent steps). The ledger is the same (``P - 1``
  rounds, messages, and ``(P - 1) * nbytes`` each way); on the emulated cluster a 1 KiB ring
  all-gather took 1.3-3.9 ms, the direct batch 0.3 ms, and with more ranks than cores every ring
  step waits for a process to be scheduled.

Learning rate: the reducer sums whatever it is given; pass ``lr * grad`` for the paper's form
(``e + eta G``) or the raw gradient for the snapshot's form (``spec/micro.md`` §4) - the threshold
adapts to either scale.

``stats``: ``selected`` = ``K_t`` (values every rank contributes and receives), ``density`` =
``K_t / n`` vs ``target_density``; ``local_selected`` (this rank's indices), ``passed`` (before the
cap), ``saturated`` (cap hit), ``threshold`` (used this step), ``next_threshold``, ``partition``,
``max_count``, ``spread``; times ``select_s``, ``comm_s`` (of which ``comm_calibrate_s``,
``comm_indices_s``, ``comm_values_s``), ``update_s``. ``r.last_indices`` /
``r.last_union`` hold this rank's selection and the union of the last step.
"""

from __future__ import annotations

import math

import torch

from ..comm import gather_padded
from ..select.threshold import (
    ThresholdController,
    Workspace,
    calibration_edges,
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
from ..blockindex import block16_bytes, block16_pays, block_count, decode_block16, encode_block16
from ..sparse import index_dtype_for
from .base import IndexedSum, Reducer
from .memory import BufferedAccumulator
from .registry import register


def value_path(values: str, P: int) -> str:
    """``values="auto"`` -> ``"gather"`` for ``P <= 2`` (the same bytes as the owner path, one round
    fewer), ``"owner"`` beyond (``(P - 1) / 2`` times fewer value bytes); any other choice as given."""
    if values == "auto":
        return "gather" if P <= 2 else "owner"
    return values


def rank_order_sum(parts: list[torch.Tensor], dtype) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` in ``dtype`` (a new tensor), added in list order: every rank that
    adds the same parts in the same order holds the same bits (the owner's and the gathered sums)."""
    total = parts[0].to(dtype, copy=True)
    for x in parts[1:]:
        total += x
    return total


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
class MicroReducer(BufferedAccumulator, Reducer):
    conserving = True
    supports_value_dtype = True
    value_dtype_conserving = True  # "owner" / "gather" keep every rounding; "allreduce" does not (set per instance)
    indexed_output = True  # _reduce returns an IndexedSum (base.reduce densifies unless asked not to)

    def __init__(self, comm, density: float = 0.01, threshold: float | None = None,
                 rule: str = "histogram", spread: float = 1.1, max_spread: float = 4.0, bins: int = 128,
                 gamma: float = 0.5, max_step: float = 2.0, band: float = 0.02, min_step: float = 1e-3,
                 grow: float = 1.5, shrink: float = 0.5, cap_factor: float | None = 4.0,
                 force_nonempty: bool = False, reuse_buffers: bool = True, gather: str = "direct",
                 values: str = "auto", start: str = "data", lead: float = 0.7, indices: str = "auto",
                 **rest):
        if values not in ("auto", "owner", "gather", "allreduce"):
            raise ValueError(f"micro: values must be 'auto', 'owner', 'gather' or 'allreduce', got {values!r}")
        self.values = values = value_path(values, comm.world_size)
        self.value_dtype_conserving = values != "allreduce"  # read by Reducer.__init__
        super().__init__(comm, density=density, **rest)
        self.threshold0 = None if threshold is None else check_threshold(threshold)
        rules = ("histogram",) + ThresholdController.RULES
        if rule not in rules:
            raise ValueError(f"micro: rule must be one of {', '.join(rules)}, got {rule!r}")
        # validate every hyperparameter now (target and delta are set on the first step)
        self.rule_options = {"rule": rule, "gamma": float(gamma), "max_step": float(max_step),
                             "band": float(band), "min_step": float(min_step), "grow": float(grow),
                             "shrink": float(shrink)}
        ThresholdController(1, 1.0, **self._controller_options())
        calibration_edges(1.0, spread, bins)
        if isinstance(bins, bool) or int(bins) != bins:
            raise ValueError(f"micro: bins must be an integer >= 1, got {bins!r}")
        if not float(max_spread) >= float(spread):
            raise ValueError(f"micro: max_spread must be >= spread, got {max_spread!r} < {spread!r}")
        self.spread, self.max_spread, self.bins = float(spread), float(max_spread), int(bins)
        self.spread_now = self.spread
        self.cap_factor = check_cap_factor(cap_factor)
        self.force_nonempty = bool(force_nonempty)
        self.reuse_buffers = bool(reuse_buffers)
        if gather not in ("direct", "ring"):
            raise ValueError(f"micro: gather must be 'direct' or 'ring', got {gather!r}")
        self.gather = gather
        if indices not in ("auto", "block16", "plain"):
            raise ValueError(f"micro: indices must be 'auto', 'block16' or 'plain', got {indices!r}")
        if indices == "auto":  # block16 where the caller chose bytes over CPU (half values)
            indices = "plain" if self.wire_dtype is None else "block16"
        self.indices = indices
        if start not in ("data", "guess"):
            raise ValueError(f"micro: start must be 'data' or 'guess', got {start!r}")
        self.start = start
        try:
            self.lead = float(lead)
        except (TypeError, ValueError):
            raise ValueError(f"micro: lead must be a number in [0, 1], got {lead!r}") from None
        if not 0.0 <= self.lead <= 1.0:
            raise ValueError(f"micro: lead must be a number in [0, 1], got {lead!r}")
        self.controller: ThresholdController | None = None
        self._ws = Workspace()
        self._bounds: list[tuple[int, int]] | None = None
        self.data_windows_left = 0  # steps whose window is still centred on sampled data (start="data")
        self.prev_threshold: float | None = None  # the threshold chosen one step before the last
        self.trend = 1.0  # ratio of the last two chosen thresholds (histogram rule): the next window's lead

    # ------------------------------------------------------------------ state
    def _extra_state(self) -> dict:
        return {"controller": None if self.controller is None else self.controller.state_dict(),
                "spread": self.spread_now, "prev_threshold": self.prev_threshold, "trend": self.trend,
                "data_windows_left": self.data_windows_left}

    def _load_extra_state(self, d: dict) -> None:
        self._forget_buffers()
        self._bounds = None
        self.spread_now = float(d.get("spread", self.spread))
        self.prev_threshold = d.get("prev_threshold")
        self.trend = float(d.get("trend", 1.0))
        self.data_windows_left = int(d.get("data_windows_left", 0))
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
            if self.threshold0 is None:  # delta_0 is a data-blind guess
                if self.start == "data":  # windows centred on the data until two thresholds give a
                    self.data_windows_left = 2  # trend (_local_estimate, _window_from_estimates)
                # "guess" (and the fallback of "data"): the widest window first (measured: with the
                # narrow one, 2-4x the target for 3 steps)
                self.spread_now = self.max_spread

    def _controller_options(self) -> dict:
        """The histogram rule keeps its window centre in a controller (unused rule "adaptive")."""
        o = dict(self.rule_options)
        if o["rule"] == "histogram":
            o["rule"] = "adaptive"
        return o

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
        ``(P - 1) * nbytes`` each way), but all messages are in flight at once: a 1 KiB gloo ring
        all-gather took 1.3-3.9 ms on the emulated 1 Gbit/s cluster, the direct batch 0.3 ms, and
        each ring step needs every process scheduled, which is what costs on an oversubscribed host.
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
        total = rank_order_sum([got[p] for p in range(P)], dtype)
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
        return rank_order_sum(self._allgather_fixed(sent), dtype)

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
            msg = encode_block16(idx, starts[comm.rank], nb).view(torch.uint8)  # gloo has no int16
            got = gather_padded(msg, [2 * (2 * nb + c) for c in known], self._allgather_fixed)
            # its own list it has already (decode(encode(idx)) == idx, tested)
            return [idx.to(torch.int64) if r == comm.rank else decode_block16(m.view(torch.int16), s, nb, c)
                    for r, (m, s, c) in enumerate(zip(got, starts, known))]

    def _index_blocks(self) -> int | None:
        """Blocks per partition for ``indices="block16"`` (None: plain indices)."""
        if self.indices != "block16" or self.comm.world_size == 1:
            return None
        return block_count(max(e - s for s, e in self._bounds))

    def _window_center(self, estimate: float | None) -> float:
        """Histogram rule: the centre of this step's window of candidate thresholds.

        Steady state (``lead``): the last threshold moved on by the last step's trend,
        ``delta_t * (delta_t / delta_{t-1}) ** lead`` (ratio clamped to [1/4, 4]). With error feedback
        and momentum the threshold drifts steadily (it grows ~2x per step over the first steps while
        the velocity and residual build up, and follows a density warm-up), so a window centred on
        the last threshold lags: its lower end lets in many more candidates than needed, and its
        ends are hit, which widens it further. Measured on the digits MLP, P = 4, 2 % with a warm-up
        from 5 % (steps 0-59, thread cluster): with ``lead=0.7`` no end was hit and every step's
        count was within 0.7 % of the target (17 % before, 4 end hits); the candidates read over
        steps 0-9 fell 3.7x. The first steps (``start="data"``, ``estimate`` given): see
        :meth:`_local_estimate`.
        """
        if estimate is not None:
            return self._window_from_estimates(estimate)
        return self.controller.delta * min(4.0, max(0.25, self.trend)) ** self.lead

    def _local_estimate(self, acc: torch.Tensor, start: int, end: int) -> float:
        """This rank's estimate of the threshold that passes its share ``k / P`` of its partition
        (0.0: none), for a window centred on the data in the steps before two thresholds give a trend.

        From a fixed pseudo-random sample (``m >= 65536`` entries, >= 256 expected above the
        estimate: ~1 ms). :meth:`_window_from_estimates` turns every rank's estimate into one window.
        Measured (digits MLP, P = 4, 5 %): 61 % of the partition passed the data-blind first window,
        16 % this one; step 1 still needs it (the threshold doubles between steps 0 and 1 there).
        """
        P, L = self.comm.world_size, end - start
        share = min(1.0, self.controller.target / P / max(L, 1))
        if L <= 0 or share >= 1.0:
            return 0.0
        m = min(L, max(1 << 16, math.ceil(256 / max(share, 1e-12))))
        g = torch.Generator(device="cpu").manual_seed(12345 + self.comm.rank)
        pos = torch.randint(start, end, (m,), generator=g).to(acc.device)
        sample = acc.index_select(0, pos).abs_().float()
        kth = max(1, min(m, m - int(share * m)))  # kth smallest = the (1 - share) quantile
        return float(sample.kthvalue(kth).values)

    def _window_from_estimates(self, estimate: float) -> float:
        """One all-gather of the ``P`` local estimates (8 bytes each; steps 0 and 1 only) gives every
        rank the same window: centred on the geometric mean of the lowest and highest estimate, wide
        enough to hold both with a 20 % margin for the sampling error. The global count at the lowest
        estimate is about ``k`` or more, at the highest about ``k`` or less, so the target lies
        inside, and the window's lowest edge - which sets how many entries the calibration reads -
        is ~``min / 1.2`` instead of ``delta_0 / 4``. Without any usable estimate (every sample all
        zero), the widest window around the current centre.
        """
        with self.timed("comm"), self.timed("comm_calibrate"), self.comm.phase(self.name + ".window"):
            mine = torch.tensor([estimate], dtype=torch.float64, device=self.comm.device)
            ests = torch.cat(self._allgather_fixed(mine)).tolist()
        usable = [e for e in ests if e > 0.0 and math.isfinite(e)]  # 0: an all-zero sample
        if not usable:
            self.spread_now = self.max_spread
            return self.controller.delta
        lo, hi = min(usable), max(usable)
        self.spread_now = min(self.max_spread, max(self.spread, 1.2 * math.sqrt(hi / lo)))
        return math.sqrt(lo * hi)

    def _next_spread(self, j: int) -> None:
        """Histogram rule: square the window's spread (up to ``max_spread``) when the chosen edge ``j``
        is an end of the window (the target may lie outside it), else move it back towards ``spread``."""
        if j in (0, self.bins):
            self.spread_now = min(self.max_spread, self.spread_now ** 2)
        else:
            self.spread_now = max(self.spread, math.sqrt(self.spread_now))

    def _reduce(self, grad):
        if self._bounds is None or self.controller is None:
            self._setup()
        self.controller.target = self.k  # follows a density changed between steps (warm-up schedules)
        comm, P, step = self.comm, self.comm.world_size, self.step
        part = owned_partition(comm.rank, step, P)
        start, end = self._bounds[part]
        cap = self._cap(end - start)
        calibrate = self.rule_options["rule"] == "histogram"
        center, estimate = self.controller.delta, None
        with self.timed("select"):
            acc = self.accumulate(grad)
            if calibrate and self.data_windows_left:
                self.data_windows_left -= 1
                estimate = self._local_estimate(acc, start, end)
        if calibrate:
            center = self._window_center(estimate)  # the estimates' all-gather is timed as comm
        with self.timed("select"):
            if calibrate:
                edges = calibration_edges(center, self.spread_now, self.bins, acc.dtype, acc.device)
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
                    # rounding error), in one visit (take_unsent; the union is ascending)
                    mine, sent = self.take_unsent(acc, union)
                    if self.values == "allreduce":
                        # the all-reduce of the values already rounded (wire_values leaves them as they are)
                        vals = self.allreduce_wire_values(sent)[1].to(acc.dtype)
                    elif self.values == "gather":
                        vals = self._gathered_sum(sent, acc.dtype)
                    else:
                        vals, sum_err = self._owner_sum(
                            sent, [lists[partition_owner(p, step, P)].numel() for p in range(P)], step,
                            acc.dtype)
        with self.timed("update"):
            if K:  # take_unsent left acc - sent in the residual
                if sum_err is not None:  # and the owner keeps its half sums' rounding error
                    acc.index_add_(0, lists[comm.rank], sum_err)
            else:
                vals = acc.new_zeros(0)
                self.residual = acc
            out = IndexedSum(union, vals, self.numel)
        if calibrate:  # next window: centred on the threshold chosen now; wider if it hit an end
            self.trend = 1.0 if self.prev_threshold is None else delta / self.prev_threshold
            self.prev_threshold = delta
            self.controller.delta = next_delta = delta
            self._next_spread(j)
        else:
            # The controller sees the transmitted K even when a rank hit its budget: a structurally
            # dense partition must not push the global threshold up (that would starve the others).
            next_delta = self.controller.update(K)
        self.last_indices, self.last_union = idx, union
        self.stats.update(selected=K, local_selected=int(idx.numel()), passed=int(passed),
                          threshold=delta, next_threshold=next_delta, partition=part,
                          saturated=cap is not None and passed > cap, max_count=max(counts),
                          spread=self.spread_now, candidates=int(cand.numel()) if calibrate else None)
        return out

    # ------------------------------------------------------------------ cost
    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, counts=None, rule="histogram", bins=128,
                       values="auto", rank=None, data_window=False, indices="auto", **_):
        """Cost per rank (``spec/micro.md`` §6, plus the calibration all-gather of the default rule;
        the value sum as the module docstring gives it for ``values``). ``data_window``: the step
        also all-gathers the 8-byte threshold estimates (``start="data"``: steps 0 and 1).

        With the per-rank ``counts`` of a step the result is exact - for ``rank`` (the owner path
        receives by rank), or the largest over ranks when ``rank`` is None; otherwise it is for
        ``K = k`` with the bounds ``m in [ceil(k/P), k]`` as a ``(low, high)`` pair (owner path:
        for the rank that sends the most indices).
        """
        if P <= 1:
            return {"rounds": 0, "bytes_received": 0}
        cal_rounds = P - 1 if rule == "histogram" else 0
        cal_bytes = (P - 1) * (int(bins) + 2) * 8 if rule == "histogram" else 0
        if data_window and rule == "histogram":
            cal_rounds, cal_bytes = cal_rounds + P - 1, cal_bytes + (P - 1) * 8
        values = value_path(values, P)
        value_rounds = P - 1 if values == "gather" else 2 * (P - 1)
        if indices == "auto":
            indices = "block16" if value_bytes < 4 else "plain"
        nb = block_count(-(-n // P)) if indices == "block16" and rule == "histogram" else None

        def index_bytes_at(m):  # one padded message per peer
            if nb is not None and block16_pays(m, nb, index_bytes):
                return (P - 1) * block16_bytes(m, nb)
            return (P - 1) * m * index_bytes

        def value_bytes_at(K, m_r):  # owner: contributions in, sums out, both as value_bytes
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
