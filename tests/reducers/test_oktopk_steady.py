"""Ok-Topk in steady state: with the residual kept between calls (error feedback, what training sees)
the local and the global selection stay within 10% of the target count for 60 steps."""

import torch

import sparsync as ss


def _heavy_tail(rank: int, j: int, n: int, scale: torch.Tensor) -> torch.Tensor:
    """Issue 11's workload: randn(n, seed 1000+17r+j) * exp(1.5 randn(n, seed 12345)) * 1e-3."""
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 + 17 * rank + j)) * scale * 1e-3


def _steady(comm, n, density, steps, opts):
    scale = torch.exp(1.5 * torch.randn(n, generator=torch.Generator().manual_seed(12345)))
    grads = [_heavy_tail(comm.rank, j, n, scale) for j in (0, 1)]
    r = ss.make_reducer("oktopk", comm, density=density, **opts)
    counts = []
    for t in range(steps):
        out = r.reduce(grads[t % 2])  # residual kept: error feedback on
        counts.append((r.stats["selected"], r.stats["global_selected"], int(torch.count_nonzero(out))))
    return r.k, counts


def test_oktopk_density_stays_on_target_with_kept_residual():
    res = ss.run_local(_steady, 4, 100_000, 0.01, 60, {})
    k = res[0][0]
    for t in range(60):
        local = [res[w][1][t][0] for w in range(4)]
        glob, nnz = res[0][1][t][1], res[0][1][t][2]
        assert all(c == k for c in local), (t, local)
        assert abs(glob / k - 1) <= 0.1, (t, glob, k)
        assert nnz <= glob  # a kept entry may sum to exactly zero, never more than kept


def test_reused_global_threshold_drifts_as_documented():
    # the paper's 32-step reuse: the count leaves the 10% band right after the estimate (why the
    # default re-estimates every step); guards the explanation in reducers/oktopk.py
    res = ss.run_local(_steady, 4, 100_000, 0.01, 8, {"recompute_every": 32})
    k = res[0][0]
    assert abs(res[0][1][0][1] / k - 1) <= 0.1
    assert max(c[1] for c in res[0][1][1:]) > 1.5 * k
