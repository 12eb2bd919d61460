"""DSAR_Split_AllGather: sparse split-and-sum, then the owned part dense, dense all-gather (SparCML thesis §3.3.4).

Same split phase as :mod:`.ssar_split_allgather` (direct sparse sends, overlapped summation); the
owned part (``N/P'`` values) is then made dense and a dense all-gather finishes. For the dynamic
case: results denser than the break-even point ``delta``.

Dense all-gather (option ``allgather``): ``"ring"`` (default) is the comm's all-gather (gloo's ring,
as MPI uses for large messages in the thesis' experiments); all ``P`` ranks take part, so folded
ranks get the result without an unfold step. ``"recdbl"`` is recursive doubling over point-to-point
messages of known size (the ``log2 P`` rounds of the thesis' formula), then unfold. Implementation
choice: ring by default, because a Python-level recursive doubling (sequential exchanges plus
concatenation copies) adds CPU time on top of its wire time that the comm's all-gather does not.

Cost per rank, ``P`` a power of two, ``N`` divisible by ``P``, ``k/P`` items per part per rank, in
**bytes received** (``s(m, d) = 8 + min(m(c+isize), d*isize)``; comm size headers excluded)::

    rounds         = (P - 1) + (P - 1)        ring      |  (P - 1) + log2 P    recdbl
    bytes_received = (P-1) * s(k/P, N/P)  +  (P-1)/P * N * isize
      (thesis: [(P-1)/P N, k + (P-1)/P N] items; the split volume is the same for every pattern)

With the ring the parts have width ``ceil(N/P')`` (:func:`~.sparcml_common.padded_bounds`; the
last ones may be shorter) so that the gathered buffer is the result without a reassembly copy; every
one of the ``P`` ranks contributes one piece of that width, so the all-gather receives
``(P-1) * ceil(N/P') * isize`` bytes (for ``N`` divisible by ``P'`` and ``P = P'`` the line above);
a non-power-of-two ``P`` adds one fold round.
"""

from __future__ import annotations

from ..sparse import SparseVec, sum_dtype
from .registry import register
from .sparcml_common import (
    phase_label,
    cost_setup,
    allgather_concat,
    as_stream,
    densify,
    fold_active,
    num,
    padded_bounds,
    part_bounds,
    ring_allgather_dense,
    unfold, union_model)
from .ssar_split_allgather import split_and_sum, split_phase_cost

ALLGATHERS = ("ring", "recdbl")


def check_allgather(name) -> str:
    if name not in ALLGATHERS:
        raise ValueError(f"dense all-gather must be one of {', '.join(ALLGATHERS)}, got {name!r}")
    return name


@register("dsar_split_allgather")
def dsar_split_allgather(sv: SparseVec, comm, allgather: str = "ring", **_):
    check_allgather(allgather)
    x = as_stream(sv)
    if comm.world_size == 1:
        return x
    f, x = fold_active(comm, x, sv.numel, sv.dtype)
    sdt = sum_dtype(sv.dtype)
    # ring: parts of width ceil(N/P') so that the gathered buffer is the result (no reassembly)
    bounds = padded_bounds(sv.numel, f.Pp) if allgather == "ring" else part_bounds(sv.numel, f.Pp)
    acc = None
    if f.active:
        bounds, acc = split_and_sum(comm, x, f, sv.numel, sv.dtype, bounds)
        if allgather != "ring":
            acc = densify(acc)
    if allgather == "ring":
        with comm.phase(phase_label(comm, "allgather")):
            return ring_allgather_dense(comm, f, acc, bounds, lambda v: v, sdt, sv.device)
    if f.active:
        with comm.phase(phase_label(comm, "allgather")):
            x = allgather_concat(comm, acc, bounds, f.vrank, f.real, sdt, dense=True)
    return unfold(comm, f, x, sv.numel, sv.dtype)


def dsar_split_allgather_cost(P, n, k, value_bytes=4, index_bytes=None, pattern="random", allgather="ring"):
    """See the module docstring (the same for every pattern)."""
    Pp, L, extra, sim = cost_setup(P, n, value_bytes, index_bytes)
    d = n // Pp
    kp = k / Pp
    union = union_model(pattern, kp, d)
    split, _ = split_phase_cost(sim, Pp, n, k, union)
    sim.densify(d)
    sim.dense_elems += (Pp - 1) * d  # concatenation copies of the dense all-gather
    ag = (Pp - 1) * d * value_bytes
    if check_allgather(allgather) == "ring":
        rounds = (Pp - 1) + (P - 1) + (1 if Pp != P else 0)      # fold only; the ring reaches everyone
        ag = (P - 1) * -(-n // Pp) * value_bytes                 # pieces of width ceil(N/P') (padded_bounds)
    else:
        rounds = (Pp - 1) + L + extra
    return {"rounds": rounds if P > 1 else 0, "bytes_received": num(split + ag), "compute": sim.work()}


register("dsar_split_allgather", cost=dsar_split_allgather_cost)(dsar_split_allgather)
