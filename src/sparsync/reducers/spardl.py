"""``spardl``: SparDL — Spar-Reduce-Scatter + (R-SAG | B-SAG) + Bruck all-gather with global residuals.

Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient Sparse Communication", ICDE
2024 (section numbers below are the paper's).
One step on rank ``w`` (team ``j = w // q``, local rank ``r = w % q``, ``q = P/d``):

1. ``A = grad + residual``, zero-padded to ``q*bs`` with ``bs = ceil(n/q)``, viewed as ``q`` blocks (§3).
2. SRS inside the team (§4, :mod:`sparsync.spardl.srs`): exact top-``kb`` per block right before it is
   sent, ``kb = max(1, floor(k*d/P))`` (capped at ``bs``); one fixed-size message per step.
3. ``d > 1``: R-SAG (``team_allgather="r"``, ``d`` a power of two) or B-SAG (``"b"``, any ``d``, with
   Algorithm 2's controller kept in the reducer) among the ranks sharing ``r`` (§6-7).
4. Bruck all-gather of the ``L = kb``-pair blocks inside the team (§5); every rank scatters the same
   blocks in the same order into a dense output -> bitwise identical on all ranks.
5. Residuals (§8): ``global`` (GRES, default, conserving), ``partial`` (PRES), ``local`` (LRES).

Error feedback goes through the reducer's memory (:class:`~sparsync.reducers.memory.ErrorFeedback`),
in its SparDL variant: ``memory.add(grad, padded=q*bs)`` writes ``A`` into one of its two alternating
work buffers (the input check in that pass), the collectives use that buffer as their store ``R``
in place, the work buffer restores ``A`` on the touched entries and names what the scheme keeps, and
the memory writes the residual: ``memory.keep(A, sent)`` (PRES, LRES: own sent entries cleared) or
``memory.keep(A)`` then ``memory.hold(I, R on I)`` (GRES), ``O(k)`` each; a residual taken from
``r.residual`` is therefore overwritten two steps later.

Passes over the ``n`` entries per call (everything else is ``O(k)``): ``A = grad + residual`` into
one of two recycled work buffers, one read by the exact per-block top-k kernel (every block is
selected once, when it is sent; the preserved block at the end), one zero fill of the recycled output
(:meth:`~sparsync.reducers.base.Reducer.zeros_output`). The residual schemes restore only the
touched entries (:class:`~sparsync.spardl.residuals.WorkBuffer`); ``partial`` tests membership in the
final index set through a persistent flag vector (:class:`~sparsync.sparse.IndexFlags`), not by
sorting, and ``global`` needs no membership test (``R`` is read on the final set before the restore
and written back after it).

Message sizes are all known in advance (``kb``/``L`` pairs per block, ``h`` per B-SAG item), so no size
header travels. Per rank, with ``c = 4 + value_bytes`` bytes per pair (int32 block-local indices)::

    d = 1:   rounds = 2*ceil(log2 P),                 bytes_received = 2*(P-1)*kb*c
    R-SAG:   rounds = 2*ceil(log2 q) + log2 d,        bytes_received = (2*(q-1) + log2 d)*kb*c
    B-SAG:   rounds = 2*ceil(log2 q) + ceil(log2 d),  bytes_received = (2*(q-1)*kb + (d-1)*h)*c

(with ``kb = k/P`` resp. ``dk/P`` these are Table I's ``4k(P-1)/P``, ``2k(2(P-d)/P + (d/P)log2 d)`` and
``[.., 2k(d^2+2P-3d)/P]`` units). ``k*d/P < 1`` (density below ``P/(d*n)``) falls back to ``kb = 1``
(documented; the effective density is then ``P/(d n)``-ish, reported in ``stats["selected"]``).

``teams="auto"``: the first ``auto_steps`` steps of every admissible ``d`` (divisors of ``P`` below ``P``;
R-SAG for powers of two, else B-SAG) are timed; the per-step max over ranks is agreed with an
unrecorded all-reduce, the ``d`` with the lowest median is kept (the paper's advice, §7.4) and the
times are reported in ``auto_times`` / ``stats["auto_times"]``.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ..spardl.bruck import bruck_allgather
from ..spardl.controller import HController
from ..spardl.residuals import RESIDUAL_MODES, WorkBuffer
from ..spardl.srs import spar_reduce_scatter
from ..spardl.teams import b_sag, r_sag
from ..spardl.wire import pack, unpack
from ..sparse import IndexFlags, add_at
from .base import Reducer
from .capabilities import OptionFact
from .registry import register


def _pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _ceil_log2(x: int) -> int:
    return (x - 1).bit_length() if x > 1 else 0


def check_teams(P: int, d, team_allgather=None) -> tuple[int, str]:
    """Validate ``d`` (teams) and the SAG kind; returns ``(d, "r"|"b"|"none")``."""
    if isinstance(d, bool) or not isinstance(d, int):
        raise ValueError(f"teams must be an integer dividing the world size or 'auto', got {d!r}")  # noqa: TRY004
    if d < 1 or P % d:
        raise ValueError(f"teams={d} must divide the world size P={P} (valid: "
                         f"{', '.join(str(x) for x in range(1, P + 1) if P % x == 0)})")
    if d == 1:
        return 1, "none"
    kind = team_allgather or ("r" if _pow2(d) else "b")
    if kind not in ("r", "b"):
        raise ValueError(f"team_allgather must be 'r' (R-SAG) or 'b' (B-SAG), got {team_allgather!r}")
    if kind == "r" and not _pow2(d):
        raise ValueError(f"R-SAG needs the number of teams to be a power of two, got teams={d}; "
                         f"use team_allgather='b' (B-SAG works for any d)")
    return d, kind


def auto_candidates(P: int) -> list[tuple[int, str]]:
    """``(d, kind)`` tried by ``teams="auto"``: every divisor ``d < P`` (and ``d = 1``)."""
    out = []
    for d in range(1, P + 1):
        if P % d == 0 and (d < P or P == 1):
            out.append(check_teams(P, d))
    return out


@register("spardl")
class SparDLReducer(Reducer):
    checks_input = True  # the finite check rides on the pass that writes grad + residual (sum_checked)
    conserving = OptionFact(True, lambda r: r.residuals == "global")  # GRES only (the default)

    def __init__(self, comm, density=0.01, teams=1, team_allgather=None, residuals="global",
                 auto_steps=3, **rest):
        super().__init__(comm, density=density, **rest)
        P = comm.world_size
        if residuals not in RESIDUAL_MODES:
            raise ValueError(f"residuals must be one of {RESIDUAL_MODES}, got {residuals!r}")
        self.residuals = residuals
        self.auto = teams == "auto"
        self.auto_steps = int(auto_steps)
        if self.auto:
            if team_allgather is not None:
                raise ValueError("team_allgather cannot be combined with teams='auto' (chosen per d)")
            self.candidates = auto_candidates(P)
            self.d, self.kind = self.candidates[0]
        else:
            self.d, self.kind = check_teams(P, teams, team_allgather)
            self.candidates = [(self.d, self.kind)]
        self.auto_times: dict[str, float] = {}
        self._trial: list[list[float]] = [[] for _ in self.candidates]
        self._controllers: dict[int, HController] = {}
        self._scratch: dict = {}  # reused selection buffers (|x|, mask), see select.exact.scratch_buffer
        self._final_set = IndexFlags()  # O(k) membership in the final index set (residuals)

    # ------------------------------------------------------------------ sizes
    def _sizes(self, d):
        P, n = self.comm.world_size, self.numel
        q = P // d
        bs = -(-n // q)
        kb = min(bs, max(1, (self.k * d) // P))
        return q, bs, kb

    @staticmethod
    def label(d, kind):
        return "d=1" if d == 1 else f"{'R' if kind == 'r' else 'B'}-SAG d={d}"

    # ------------------------------------------------------------------ one step
    def _reduce(self, grad):
        if self.auto and not self.auto_times:
            ci = min(self.step // max(1, self.auto_steps), len(self.candidates) - 1)
            d, kind = self.candidates[ci]
            t0 = time.perf_counter()
            out = self._reduce_with(grad, d, kind)
            self._trial[ci].append(time.perf_counter() - t0)
            if ci == len(self.candidates) - 1 and len(self._trial[ci]) >= self.auto_steps:
                self._decide()
            return out
        return self._reduce_with(grad, self.d, self.kind)

    def _decide(self):
        T = torch.tensor([[statistics.median(ts) if ts else float("inf")] for ts in self._trial],
                         dtype=torch.float64, device=self.comm.device).view(-1)
        with self.comm.unrecorded():
            T = self.comm.allreduce(T, "max")  # every rank decides from the same numbers
        best = int(torch.argmin(T))
        self.auto_times = {self.label(*c): float(t) for c, t in zip(self.candidates, T)}
        self.d, self.kind = self.candidates[best]
        self.stats["auto_times"] = dict(self.auto_times)
        self.stats["auto_choice"] = self.label(self.d, self.kind)

    def _reduce_with(self, grad, d, kind):
        comm = self.comm
        P, w, n = comm.world_size, comm.rank, self.numel
        q, bs, kb = self._sizes(d)
        if bs >= 2**31:
            raise ValueError(f"block of {bs} elements does not fit int32 block-local indices")
        team, r = divmod(w, q)
        team_group = [team * q + i for i in range(q)]
        sag_group = [j * q + r for j in range(d)]
        with self.timed("select"):
            # grad + residual, zero-padded to q*bs, in one of the memory's two alternating work buffers
            # (the input check in the same pass: raises here); the residual of this step lives in it
            A = self.memory.add(grad, padded=q * bs)
            work = WorkBuffer(A, q, bs)
        with comm.phase(f"{self.name}:srs"):
            idx, vals = spar_reduce_scatter(comm, work, kb, team_group, r, self.timed, self._scratch)
        if d > 1:
            with comm.phase(f"{self.name}:sag"):
                if kind == "r":
                    idx, vals = r_sag(comm, idx, vals, kb, sag_group, team, work, r, self.timed)
                else:
                    ctl = self._controllers.get(d)
                    if ctl is None:
                        ctl = self._controllers[d] = HController(P, d, self.k, L=kb)
                    idx, vals, n_t = b_sag(comm, idx, vals, kb, ctl.h_used, sag_group, team, work, r,
                                           self.timed)
                    self.stats["h"] = ctl.h_used
                    self.stats["N_t"] = n_t
                    ctl.update(n_t)
        with comm.phase(f"{self.name}:bruck"), self.timed("comm"):
            items = bruck_allgather(comm, pack(idx, vals), team_group, r)
        with self.timed("select"):
            parts = [unpack(x, 1, kb, vals.dtype) for x in items]
            blocks = torch.arange(q, device=A.device)[:, None] * bs
            fpos = (torch.cat([p[0] for p in parts]) + blocks).view(-1)
            fval = torch.cat([p[1] for p in parts]).view(-1)
            out = self.zeros_output(q * bs, grad.dtype, grad.device)  # recycled: no page faults
            add_at(out, fpos, fval)
            pos, held = work.finish(self.residuals, fpos, n, self._final_set)  # A is A again; the scheme's part
            self.memory.keep(A[:n], None if held is not None else pos)  # partial / local: own sent entries cleared
            if held is not None:  # global: the in-procedure store on I
                self.memory.hold(pos, held)
        self.stats["selected"] = q * kb
        self.stats["teams"] = self.label(d, kind)
        if self.auto_times:
            self.stats["auto_times"] = dict(self.auto_times)
        return out[:n]

    # ------------------------------------------------------------------ state
    def _extra_state(self):
        return {"d": self.d, "kind": self.kind, "auto_times": dict(self.auto_times),
                "trial": [list(t) for t in self._trial],
                "controllers": {d: c.state() for d, c in self._controllers.items()}}

    def _load_extra_state(self, s):
        if not s:
            return
        self.d, self.kind = s["d"], s["kind"]
        self.auto_times = dict(s.get("auto_times", {}))
        self._trial = [list(t) for t in s.get("trial", self._trial)]
        for d, st in s.get("controllers", {}).items():
            c = self._controllers[d] = HController(self.comm.world_size, d, self.k, L=self._sizes(d)[2])
            c.load(st)

    # ------------------------------------------------------------------ cost model
    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, teams=1, team_allgather=None, **_):
        """Exact integer ledger (fixed capacity, int32 block-local indices: ``c = 4 + value_bytes``).

        B-SAG gives ``(low, high)`` bytes for ``h`` in ``[ceil(k/P), L]``.
        """
        d, kind = check_teams(P, teams, team_allgather)
        q = P // d
        bs = -(-n // q)
        kb = min(bs, max(1, (k * d) // P))
        c = 4 + value_bytes
        lq = _ceil_log2(q)
        base = 2 * (q - 1) * kb * c
        if d == 1:
            return {"rounds": 2 * lq, "bytes_received": base}
        if kind == "r":
            ld = _ceil_log2(d)
            return {"rounds": 2 * lq + ld, "bytes_received": base + ld * kb * c}
        hmin = min(kb, max(1, -(-k // P)))
        return {"rounds": 2 * lq + _ceil_log2(d),
                "bytes_received": (base + (d - 1) * hmin * c, base + (d - 1) * kb * c)}

    @staticmethod
    def table_cost(P, k, d=1, kind="none"):
        """The paper's Table I bandwidth in (index+value) units (B-SAG lower bound corrected, §7.3)."""
        if d == 1:
            return 4 * k * (P - 1) / P
        if kind == "r":
            return 2 * k * (2 * (P - d) / P + (d / P) * math.log2(d))
        return (2 * k * (P * d + P - 2 * d) / (P * d), 2 * k * (d * d + 2 * P - 3 * d) / P)
