"""Synthetic sparse inputs (``sparsync.bench.patterns``): supports, overlap, determinism, errors."""

import pytest
import torch

from sparsync.bench.patterns import PATTERNS, make_sparse, sample_distinct
from sparsync.select.topk import k_for_density


def _check_valid(sv, numel, k):
    assert sv.numel == numel and sv.nnz == k
    assert sv.indices.dtype == torch.int64
    if k:
        assert int(sv.indices.min()) >= 0 and int(sv.indices.max()) < numel
        assert bool(torch.all(sv.indices[1:] > sv.indices[:-1]))  # sorted, unique
        assert bool(torch.all(sv.values != 0))


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("P,numel,density", [(1, 10, 1.0), (4, 1000, 0.01), (5, 12345, 0.05), (8, 100_000, 0.1),
                                             (3, 7, 0.3)])
def test_patterns_valid_and_deterministic(pattern, P, numel, density):
    k = k_for_density(numel, density)
    if pattern == "disjoint" and P * k > numel:
        with pytest.raises(ValueError, match="disjoint"):
            make_sparse(pattern, 0, P, numel, density)
        return
    svs = [make_sparse(pattern, r, P, numel, density, seed=3) for r in range(P)]
    for sv in svs:
        _check_valid(sv, numel, k)
    again = [make_sparse(pattern, r, P, numel, density, seed=3) for r in range(P)]
    assert all(a == b for a, b in zip(svs, again))
    union = torch.unique(torch.cat([s.indices for s in svs])).numel()
    if pattern == "identical":
        assert union == k
        assert all(torch.equal(s.indices, svs[0].indices) for s in svs)
        if P > 1:
            assert not torch.equal(svs[0].values, svs[1].values)
    elif pattern == "disjoint":
        assert union == P * k
    else:
        assert k <= union <= min(numel, P * k)


def test_random_union_matches_expectation_and_seeds_differ():
    P, n, d = 8, 200_000, 0.05
    svs = [make_sparse("random", r, P, n, d) for r in range(P)]
    union = torch.unique(torch.cat([s.indices for s in svs])).numel()
    expect = n * (1 - (1 - d) ** P)
    assert abs(union - expect) < 0.01 * expect
    a, b = make_sparse("random", 0, P, n, d, seed=0), make_sparse("random", 0, P, n, d, seed=1)
    assert not torch.equal(a.indices, b.indices)
    assert make_sparse("random", 0, 2, n, d, dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("n,k", [(20, 3), (400, 5)])  # randperm branch and oversampling branch
def test_sample_distinct_is_uniform(n, k):
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_distinct(n, k, g) for _ in range(3000)])
    assert bool(torch.all(draws[:, 1:] > draws[:, :-1]))
    counts = torch.bincount(draws.flatten(), minlength=n).double()
    expect = 3000 * k / n
    # every value equally likely: chi-square statistic near its mean n-1 (sd sqrt(2(n-1)))
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < (n - 1) + 6 * (2 * (n - 1)) ** 0.5


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown pattern"):
        make_sparse("clustered", 0, 2, 100, 0.1)
    with pytest.raises(ValueError, match="density"):
        make_sparse("random", 0, 2, 100, 0.0)
    with pytest.raises(ValueError, match="rank"):
        make_sparse("random", 2, 2, 100, 0.1)
    with pytest.raises(ValueError, match="disjoint"):
        make_sparse("disjoint", 0, 4, 100, 0.5)
    with pytest.raises(ValueError, match="distinct"):
        sample_distinct(5, 6, torch.Generator())


def test_heavy_tail_is_the_issue_11_workload():
    from sparsync.bench.patterns import heavy_tail_grad, heavy_tail_grads

    n, P = 40_000, 4
    scale = torch.exp(1.5 * torch.randn(n, generator=torch.Generator().manual_seed(12345)))
    for r, j in [(0, 0), (2, 1)]:
        g = torch.randn(n, generator=torch.Generator().manual_seed(1000 + 17 * r + j)) * scale * 1e-3
        assert torch.allclose(heavy_tail_grad(r, j, n), g, rtol=1e-6, atol=0)
    g0, g1 = heavy_tail_grads(3, n)
    assert torch.equal(g0, heavy_tail_grad(3, 0, n)) and torch.equal(g1, heavy_tail_grad(3, 1, n))
    # sparse input: the exact top-1% of |g_{r,j}|; the shared scale makes the supports overlap partly
    svs = [make_sparse("heavy_tail", r, P, n, 0.01, variant=1) for r in range(P)]
    k = k_for_density(n, 0.01)
    for r, sv in enumerate(svs):
        _check_valid(sv, n, k)
        g = heavy_tail_grad(r, 1, n)
        assert set(sv.indices.tolist()) == set(torch.topk(g.abs(), k).indices.tolist())
        assert torch.equal(sv.values, g[sv.indices])
    union = torch.unique(torch.cat([s.indices for s in svs])).numel()
    assert 1.5 * k < union < 3.0 * k  # ~2.3% of n for four top-1% sets (independent would be ~3.94%)
    assert not torch.equal(svs[0].indices, make_sparse("heavy_tail", 0, P, n, 0.01, variant=0).indices)
