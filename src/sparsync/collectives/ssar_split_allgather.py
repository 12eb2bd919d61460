"""SSAR_Split_AllGather: split into P index ranges, direct sparse sends, sparse all-gather (SparCML thesis §3.3.3).

Algorithm on the ``P'`` survivors of the fold (§3.3.3; overlap as in §4.1.4)::

    parts j = [j*w, (j+1)*w), w = floor(N/P'), last part takes the remainder
    split the local stream into P' re-based sub-streams; post all P'-1 sends at once
    (counts first, then payloads); sum each arriving part into the owned one in a fixed order
    while the later ones are still in flight (auto switch to dense, dimension N/P')
    recursive-doubling all-gather of the owned part: merge = concatenation (case 2), lower first

Every part is summed on exactly one rank and then copied, so all ranks are bitwise identical.
Best for larger data: volume ``~2k`` instead of ``log2 P * k``, at the price of ``P-1`` extra latencies.

Cost per rank, ``P`` a power of two, ``N`` divisible by ``P``, every rank contributing ``k`` items
spread evenly over the parts (``k/P`` per part, the analysis assumption), in **bytes received**
(``s(m, d) = 8 + min(m(c+isize), d*isize)``; comm size headers excluded)::

    rounds = (P - 1) + log2 P
    split:      (P-1) * s(k/P, N/P)
    all-gather: sum_{t=0..log2P-1} s(2^t u, 2^t N/P)      u = items of one summed part
      identical (K = k):   u = k/P  -> ~ 2(P-1)/P * k items   (thesis: 2(P-1)/P k)
      disjoint  (K = kP):  u = k    -> ~ P k - k/P items      (thesis: P k upper bound)
      random: between the two; expected u = f(k/P, N/P, P)

with the dense switch of the code (upper-bound rule while summing, §4.1.3 case 1a; concatenation 2a-2d).
"""

from __future__ import annotations

import torch

from ..recycle import fill_zero
from ..sparse import SparseVec, as_dtype, sum_dtype
from .registry import register
from .sparcml_common import (
    Fold,
    as_stream,
    stream_count,
    pow2_floor,
    write_block,
    run_folded,
    phase_label,
    cost_setup,
    allgather_concat,
    direct_split_sum,
    num,
    part_bounds,
    union_model,
)


def split_and_sum(comm, x, f, numel, dtype, bounds=None, while_waiting=None):
    """Split phase over all ``P'`` survivors; returns (bounds, owned summed part).

    ``bounds``: the ``P'`` index ranges (default :func:`part_bounds`, the thesis' split);
    ``while_waiting``: see :func:`~.sparcml_common.direct_split_sum`."""
    bounds = part_bounds(numel, f.Pp) if bounds is None else bounds
    peers = [f.real(v) for v in range(f.Pp)]
    with comm.phase(phase_label(comm, "split")):
        acc = direct_split_sum(comm, x, bounds, peers, f.vrank, dtype, while_waiting)
    return bounds, acc


@register("ssar_split_allgather", dense=True)
def ssar_split_allgather(sv: SparseVec, comm, dense: bool = False, out=None, out_zeroed: bool = True, **_):
    """The exact sum as a payload, or with ``dense=True`` written into ``out`` (``sv.numel`` elements
    of the sum dtype; zero-filled unless ``out_zeroed=False``, then zeroed here while the split
    phase's messages travel). Dense, without a fold (``P`` a power of two), the all-gather writes
    every block into ``out`` while the next one travels, instead of building the concatenation."""
    if dense:
        out = out if out is not None else torch.zeros(sv.numel, dtype=sum_dtype(sv.dtype), device=sv.device)
        if comm.world_size == 1 or pow2_floor(comm.world_size) != comm.world_size:
            if not out_zeroed:
                fill_zero(out)
            write_block(out, as_dtype(run_folded(sv, comm, lambda x, f: _split_allgather(comm, sv, x, f)),
                                      out.dtype), 0)
            return out
        f = Fold(comm.rank, comm.world_size)
        bounds, acc = split_and_sum(comm, as_stream(sv), f, sv.numel, sv.dtype,
                                    while_waiting=None if out_zeroed else (lambda: fill_zero(out)))
        with comm.phase(phase_label(comm, "allgather")):
            allgather_concat(comm, acc, bounds, f.vrank, f.real, acc.dtype, counts=_part_counts(comm, f, acc),
                             sink=lambda x, offset: write_block(out, x, offset))
        return out
    return run_folded(sv, comm, lambda x, f: _split_allgather(comm, sv, x, f))


def _split_allgather(comm, sv, x, f):
    bounds, acc = split_and_sum(comm, x, f, sv.numel, sv.dtype)
    with comm.phase(phase_label(comm, "allgather")):
        return allgather_concat(comm, acc, bounds, f.vrank, f.real, acc.dtype,  # sums: >= fp32
                                counts=_part_counts(comm, f, acc))


def _part_counts(comm, f, acc):
    """Every summed part's stream count, gathered once (one small gather, header traffic), so that
    the all-gather's steps know their sizes; None on a folded world (the survivors alone would have
    to gather them), where every step exchanges a size header instead."""
    return comm.gather_counts(stream_count(acc)) if f.e == 0 else None


def split_phase_cost(sim, P, n, k, union):
    """Bytes of the split phase and the state (items, dense) of the summed part (the ``P`` parts
    summed at once, ``sum_streams``: the actual union ``union(P)`` decides sparse or dense)."""
    d = n // P
    kp = k / P
    s0 = sim.start(kp, d)
    recv = (P - 1) * sim.bytes(s0, d)
    return recv, sim.add_many([s0] * P, union(P), d)


def split_allgather_cost(P, n, k, value_bytes=4, index_bytes=None, pattern="random"):
    """See the module docstring. ``pattern``: identical | disjoint | random (-> (low, high)) | expected.

    ``compute``: local work on the critical path (for ``random`` that of the disjoint bound).
    """
    Pp, L, extra, sim = cost_setup(P, n, value_bytes, index_bytes)
    d = n // Pp
    kp = k / Pp

    def run(union):
        sim.reset()
        recv, part = split_phase_cost(sim, Pp, n, k, union)
        blk, dim = part, d
        for _ in range(L):
            recv += sim.bytes(blk, dim)
            blk = sim.concat(blk, blk, 2 * dim)
            dim *= 2
        return recv, sim.work()

    ident, w_ident = run(union_model("identical", kp, d))
    disj, w_disj = run(union_model("disjoint", kp, d))
    if pattern in ("identical", "disjoint", "expected"):
        b, w = run(union_model(pattern, kp, d))
    else:
        b, w = (min(ident, disj), max(ident, disj)), w_disj
    return {"rounds": (Pp - 1) + L + extra if Pp > 1 else 0, "bytes_received": num(b), "compute": w}


register("ssar_split_allgather", cost=split_allgather_cost, dense=True)(ssar_split_allgather)
