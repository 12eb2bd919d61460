"""Early-switching DSAR: sparse inside groups, dense across groups, dense all-gather (SparCML thesis §3.3.4).

Our reading of the thesis (it leaves the group phases open), on the ``P'`` survivors
of the fold, with group size ``G`` (option ``group_size``, default 8, a power of two; capped at
``P'``), ``Q = P'/G`` groups, group ``g = vrank // G``, position ``p = vrank mod G``::

    Phase 1 (sparse, inside the group): split the local stream into G parts (size N/G); direct sends
            of part j to the member at position j (counts first, overlapped summation); densify
            -> D_p (dense, N/G)
    Phase 2 (dense, across groups): the Q ranks with position p run a recursive-halving
            reduce-scatter on D_p -> rank (g, p) owns sub-chunk g of part p = chunk id p*Q + g
    Phase 3 (dense, all ranks): all-gather in chunk-id order (chunk c lives on the rank with
            p = c // Q, g = c mod Q); option ``allgather``: "ring" (default, the comm's all-gather,
            folded ranks take part and need no unfold) or "recdbl" (recursive doubling + unfold),
            as in :mod:`.dsar_split_allgather`

Each chunk is summed on exactly one rank, so the result is bitwise identical everywhere.

Cost per rank, ``P`` a power of two, ``N`` divisible by ``P``, ``k/P`` items per ``N/P`` range per
rank, in **bytes received** (``s(m, d) = 8 + min(m(c+isize), d*isize)``; comm headers excluded)::

    rounds         = (G - 1) + log2(P/G) + (P - 1)      ring   |  ... + log2 P   recdbl
    bytes_received = (G-1) * s(k/G, N/G)                  Phase 1 (<= k items, thesis-style)
                   + (1 - G/P) * (N/G) * isize            Phase 2
                   + (P-1)/P * N * isize                  Phase 3
(the same for every pattern). With ``G >= P`` it is :mod:`.dsar_split_allgather`.
"""

from __future__ import annotations

from ..sparse import SparseVec, sum_dtype
from .dsar_split_allgather import check_allgather
from .registry import register
from .sparcml_common import (
    phase_label,
    CostSim,
    allgather_concat,
    as_stream,
    densify,
    direct_split_sum,
    fold_active,
    index_bytes_for,
    log2i,
    num,
    part_bounds,
    pow2_floor,
    ring_allgather_dense,
    unfold, union_model)


def _check_group(G) -> int:
    G = int(G)
    if G < 1 or G & (G - 1):
        raise ValueError(f"dsar_early_switch: group_size must be a power of two >= 1, got {G}")
    return G


def early_switch_payload(comm, x, f, numel, dtype, G):
    """Phases 1 and 2 on an active rank; returns the fully reduced dense chunk ``p*Q + g``."""
    Pp = f.Pp
    G = min(G, Pp)
    Q = Pp // G
    g, p = divmod(f.vrank, G)
    # Phase 1: sparse split inside the group
    gb = part_bounds(numel, G)
    with comm.phase(phase_label(comm, "group-split")):
        acc = direct_split_sum(comm, x, gb, [f.real(g * G + j) for j in range(G)], p, dtype)
    D = densify(acc).to(sum_dtype(dtype))  # a group of one did not sum: half values are summed in fp32
    # Phase 2: dense recursive-halving reduce-scatter across the Q groups (same position p)
    sub = part_bounds(gb[p + 1] - gb[p], Q)          # sub-chunks of part p, local coordinates
    lo, hi = 0, Q                                      # chunk range [lo, hi) this rank still holds
    with comm.phase(phase_label(comm, "reduce-scatter")):
        mask = Q // 2
        while mask >= 1:
            partner = f.real((g ^ mask) * G + p)
            mid = lo + (hi - lo) // 2
            if g & mask:
                keep, give = (mid, hi), (lo, mid)
            else:
                keep, give = (lo, mid), (mid, hi)
            send = D[sub[give[0]] - sub[lo]: sub[give[1]] - sub[lo]]
            n_keep = sub[keep[1]] - sub[keep[0]]
            got = comm.sendrecv(send, partner, partner, recv_numel=n_keep, recv_dtype=D.dtype)
            mine = D[sub[keep[0]] - sub[lo]: sub[keep[1]] - sub[lo]]
            D = mine + got                            # two operands: commutative, both partners agree
            lo, hi = keep
            mask //= 2
    return D


def chunk_bounds(numel, G, Q):
    """Boundaries of the ``G*Q`` chunks in chunk-id order ``c = p*Q + g``."""
    gb = part_bounds(numel, G)
    bounds = [gb[pp] + sub_b for pp in range(G) for sub_b in part_bounds(gb[pp + 1] - gb[pp], Q)[:-1]]
    bounds.append(numel)
    return bounds


@register("dsar_early_switch")
def dsar_early_switch(sv: SparseVec, comm, group_size: int = 8, allgather: str = "ring", **_):
    G = _check_group(group_size)
    check_allgather(allgather)
    x = as_stream(sv)
    if comm.world_size == 1:
        return x
    f, x = fold_active(comm, x, sv.numel, sv.dtype)
    sdt = sum_dtype(sv.dtype)
    Gp = min(G, f.Pp)
    Q = f.Pp // Gp
    bounds = chunk_bounds(sv.numel, Gp, Q)

    def chunk_of(v):  # chunk id held by virtual rank v = g*G + p
        g, p = divmod(v, Gp)
        return p * Q + g

    D = early_switch_payload(comm, x, f, sv.numel, sv.dtype, G) if f.active else None
    # Phase 3: dense all-gather over all ranks, result in chunk-id order
    with comm.phase(phase_label(comm, "allgather")):
        if allgather == "ring":
            return ring_allgather_dense(comm, f, D, bounds, chunk_of, sdt, sv.device)
        if f.active:
            x = allgather_concat(comm, D, bounds, chunk_of(f.vrank), lambda c: f.real((c % Q) * Gp + c // Q),
                                 sdt, dense=True)
    return unfold(comm, f, x, sv.numel, sv.dtype)


def dsar_early_switch_cost(P, n, k, value_bytes=4, index_bytes=None, pattern="random", group_size=8,
                           allgather="ring"):
    """See the module docstring (the same for every pattern)."""
    if index_bytes is None:
        index_bytes = index_bytes_for(n)
    Pp = pow2_floor(P)
    G = min(_check_group(group_size), Pp)
    Q = Pp // G
    extra = 2 if Pp != P else 0
    sim = CostSim(value_bytes, index_bytes)
    dg = n // G
    kg = k / G
    union = union_model(pattern, kg, dg)
    b1 = (G - 1) * sim.bytes(sim.start(kg, dg), dg)
    sim.add_many([sim.start(kg, dg)] * G, union(G), dg)
    sim.densify(dg)
    sim.dense_elems += (dg - dg // Q) + (Pp - 1) * (n // Pp)  # reduce-scatter adds, all-gather copies
    b2 = (Q - 1) * (dg // Q) * value_bytes
    if check_allgather(allgather) == "ring":
        m = max(b - a for a, b in zip(chunk_bounds(n, G, Q)[:-1], chunk_bounds(n, G, Q)[1:]))
        b3 = (P - 1) * m * value_bytes
        rounds = (G - 1) + log2i(Q) + (P - 1) + (1 if Pp != P else 0)
    else:
        b3 = (Pp - 1) * (n // Pp) * value_bytes
        rounds = (G - 1) + log2i(Q) + log2i(Pp) + extra
    rounds = rounds if P > 1 else 0
    return {"rounds": rounds, "bytes_received": num(b1 + b2 + b3), "compute": sim.work()}


register("dsar_early_switch", cost=dsar_early_switch_cost)(dsar_early_switch)
