"""Reducers' cross-rank agreement and ledgers, held to exact values a plausible mutation changes.

* TopkA: cross-rank agreement with *overlapping* indices of mixed magnitude, so the summation order
  changes the float result (a rank-rotated sum order is caught).
* gTopk: the ledger's bytes per rank equal the exact count (not a bound twice as large).
* MiCRO: the ledger is compared with bytes computed independently from the data (not from the counts
  the reducer reports).
"""

import torch

import sparsync as ss


# ---------------------------------------------------------------------- TopkA, overlapping indices
def _topka_overlap(comm, n, k):
    g = torch.Generator().manual_seed(comm.rank)
    grad = torch.randn(n, generator=g) * 1e-3
    hot = torch.arange(0, n, n // k)[:k]  # the same k indices are the top-k on every rank
    grad[hot] = (torch.rand(k, generator=g) + 1) * torch.tensor([1e6, -1.0, 3e-1, 7e4]).repeat(k // 4 + 1)[:k]
    r = ss.make_reducer("topka", comm, density=k / n)
    out = r.reduce(grad.clone())
    return out, r.stats, grad[hot].double()


def test_topka_agreement_with_overlapping_indices():
    n, k = 400, 16
    for P in (3, 4, 5):
        res = ss.run_local(_topka_overlap, P, n, k)
        outs = [o for o, _, _ in res]
        assert all(torch.equal(o, outs[0]) for o in outs), f"P={P}: ranks disagree bitwise"
        ref = sum(h for _, _, h in res)
        hot = torch.arange(0, n, n // k)[:k]
        assert torch.allclose(outs[0][hot].double(), ref, rtol=1e-6)


# ---------------------------------------------------------------------- gTopk exact bytes
def _gtopk_ledger(comm, n, density):
    r = ss.make_reducer("gtopk", comm, density=density)
    g = torch.Generator().manual_seed(comm.rank)
    comm.ledger.reset()
    r.reduce(torch.randn(n, generator=g))
    return comm.ledger.bytes_received, r.k


def test_gtopk_exact_bytes_per_rank():
    """Rank ``r`` receives ``tz(r)`` lists of ``k`` pairs in the reduction (``tz`` = trailing zero bits,
    ``log2 P`` for rank 0) and one list in the broadcast (all but rank 0); a pair is 4 + 4 bytes."""
    for P in (2, 4, 8):
        lg = P.bit_length() - 1
        for r, (nbytes, k) in enumerate(ss.run_local(_gtopk_ledger, P, 3000, 0.01)):
            tz = lg if r == 0 else (r & -r).bit_length() - 1
            assert nbytes == (tz + (r != 0)) * k * 8, (P, r, nbytes)


# ---------------------------------------------------------------------- MiCRO ledger, independent
def _micro_first_step(comm, n, delta, values):
    g = torch.Generator().manual_seed(comm.rank)
    grad = torch.randn(n, generator=g)
    r = ss.make_reducer("micro", comm, density=0.02, rule="micro", threshold=delta, cap_factor=None,
                        values=values)
    comm.ledger.reset()
    r.reduce(grad.clone())
    return grad, comm.ledger.bytes_received, comm.ledger.rounds


def test_micro_ledger_from_the_data():
    """Step 0: rank ``r`` scans partition ``r`` (sizes ``ceil``/``floor`` of ``n/P``) and sends the entries
    with ``|g| >= delta``; the ring all-gather of int32 indices receives ``(P-1) * max count * 4``
    bytes; the values: ``values="allreduce"`` - the ring all-reduce of the ``K`` float32 values,
    ``2(P-1) K 4 // P``; ``values="owner"`` - rank ``r`` receives the ``P-1`` contributions at its own
    ``c_r`` indices and the ``K - c_r`` sums of the other owners, ``((P-1) c_r + K - c_r) 4``;
    ``values="gather"`` - every peer's ``K`` contributions in one batch, ``(P-1) K 4``."""
    n, delta = 1001, 1.5
    for values in ("owner", "allreduce", "gather"):
        for P in (2, 3, 4):
            res = ss.run_local(_micro_first_step, P, n, delta, values)
            q, rem = divmod(n, P)
            starts = [0]
            for p in range(P):
                starts.append(starts[-1] + q + (p < rem))
            counts = [int((res[r][0][starts[r]:starts[r + 1]].abs() >= delta).sum()) for r in range(P)]
            K, m = sum(counts), max(counts)
            for r, (_, nbytes, rounds) in enumerate(res):
                if values == "allreduce":
                    expect = (P - 1) * m * 4 + 2 * (P - 1) * K * 4 // P
                elif values == "gather":
                    expect = (P - 1) * m * 4 + (P - 1) * K * 4
                else:
                    expect = (P - 1) * m * 4 + ((P - 1) * counts[r] + K - counts[r]) * 4
                assert nbytes == expect, (values, P, r, counts, nbytes)
                assert rounds == (2 if values == "gather" else 3) * (P - 1)
