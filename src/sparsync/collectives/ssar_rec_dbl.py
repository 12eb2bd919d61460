"""SSAR_Rec_Dbl: recursive doubling with a sparse summation at every stage (SparCML thesis §3.3.3).

Algorithm (after the fold of :mod:`.sparcml_common` when ``P`` is not a power of two)::

    v = local stream (dense directly if k items are not smaller than dense)
    for t in 0 .. log2(P')-1:
        partner = vrank XOR 2^t
        exchange v with partner (variable size: count header, then the encoded stream)
        v = add(v, received)          # sum_into_stream case 1, auto switch to dense
    return v

Both partners compute the same two-operand sum (``add`` is bitwise commutative), so all ranks end
bitwise identical. Best for small data (latency bound: only ``log2 P`` rounds).

Cost per rank, ``P`` a power of two, every rank contributing ``k`` items, in **bytes received**
(``s(m, d) = 8 + min(m(c+isize), d*isize)`` is the encoded stream, ``c = 4`` for int32 indices,
``isize = 4`` for float32; comm size headers excluded)::

    rounds         = log2 P
    bytes_received = sum_{t=0..log2P-1} s(m_t, N)        m_t = items held before stage t
      identical (K = k):   m_t = k                 ->  log2 P * (8 + k(c+isize))    (thesis: log2P * k)
      disjoint  (K = kP):  m_t = 2^t k             ->  8 log2 P + (P-1) k (c+isize)  (thesis: (P-1) k)
      random: between the two; expected  sum_t s(f(k, N, 2^t), N)   with f(k,N,P) = N(1-(1-k/N)^P)

with the dense switch applied as the code does (upper bound ``m_a + m_b`` decides, §4.1.3 case 1a).
Non-power-of-two ``P``: the formula of ``P' = 2^floor(log2 P)`` plus 2 rounds (fold, unfold) on the
paired ranks.
"""

from __future__ import annotations

from ..sparse import SparseVec, add
from .registry import register
from .sparcml_common import (
    run_folded,
    cost_setup,
    exchange_stream,
    union_model,
)


def rec_dbl_payload(x, comm, f, numel, dtype):
    """The recursive-doubling stages on the survivors (``f`` from :func:`fold`)."""
    t = 1
    while t < f.Pp:
        partner = f.real(f.vrank ^ t)
        got = exchange_stream(comm, x, partner, numel, x.dtype)  # the partner is in the same state
        x = add(x, got)
        t *= 2
    return x


@register("ssar_rec_dbl")
def ssar_rec_dbl(sv: SparseVec, comm, **_):
    return run_folded(sv, comm, lambda x, f: rec_dbl_payload(x, comm, f, sv.numel, sv.dtype))


def rec_dbl_cost(P, n, k, value_bytes=4, index_bytes=None, pattern="random"):
    """See the module docstring. ``pattern``: identical | disjoint | random (-> (low, high)) | expected.

    ``compute``: local work on the critical path (:class:`~.sparcml_common.CostSim`; for ``random``
    that of the disjoint bound), used by ``auto``.
    """
    Pp, L, extra, sim = cost_setup(P, n, value_bytes, index_bytes)

    def run(union_of):
        sim.reset()
        s = sim.start(k, n)
        total = 0
        for t in range(L):
            total += sim.bytes(s, n)
            s = sim.add(s, s, union_of(t + 1), n)
        return total, sim.work()

    def stage_union(pat):  # union after stage t sums 2^t inputs of k items
        u = union_model(pat, k, n)
        return lambda t: u(2 ** t)

    ident, w_ident = run(stage_union("identical"))
    disj, w_disj = run(stage_union("disjoint"))
    if pattern in ("identical", "disjoint", "expected"):
        b, w = run(stage_union(pattern))
    else:
        b, w = (min(ident, disj), max(ident, disj)), w_disj
    return {"rounds": L + extra, "bytes_received": b, "compute": w}


register("ssar_rec_dbl", cost=rec_dbl_cost)(ssar_rec_dbl)
