"""SparCML selection kernels: approximate top-k (expected count k, probabilities in [0, 1]),
the "at most k" variant, bucketed top-k, seeding."""

import math

import pytest
import torch

from sparsync.select.approx import (
    approx_topk,
    approx_topk_at_most,
    approx_topk_probs,
    at_most_probs,
    bucket_probs,
    bucketed_sample,
    bucketed_topk,
    make_generator,
)


def test_worked_example_probabilities():
    v = torch.tensor([4.0, -2.0, 1.0, 0.0, 0.0, 1.0])  # hand-worked example §6
    assert torch.allclose(approx_topk_probs(v, 2), torch.tensor([1, 0.5, 0.25, 0, 0, 0.25]))
    assert torch.allclose(approx_topk_probs(v, 3), torch.tensor([1, 0.625, 0.4375, 0.25, 0.25, 0.4375]))


@pytest.mark.parametrize("k", [1, 10, 100, 1000, 4999])
@pytest.mark.parametrize("dist", ["normal", "heavy", "spiky"])
def test_probabilities_sum_to_k_and_in_unit_interval(k, dist):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(5000, generator=g, dtype=torch.float64)
    if dist == "heavy":
        x = x ** 5
    elif dist == "spiky":
        x[:3] = 1e6  # L-inf branch with eps > 0
    p = approx_topk_probs(x, k)
    assert float(p.min()) >= 0 and float(p.max()) <= 1
    assert math.isclose(float(p.sum()), k, rel_tol=1e-9)
    q = at_most_probs(x, k)
    assert float(q.min()) >= 0 and float(q.max()) <= 1 and float(q.sum()) <= k + 1e-9


def test_expected_count_statistical():
    # sum of independent Bernoullis: mean k, variance sum p(1-p); 200 draws, fixed seed, 5 sigma
    x = torch.randn(20000, generator=torch.Generator().manual_seed(0)) ** 3
    k = 500
    p = approx_topk_probs(x, k).double()
    var = float((p * (1 - p)).sum())
    gen = make_generator(123)
    draws = [approx_topk(x, k, generator=gen)[0].numel() for _ in range(200)]
    mean = sum(draws) / len(draws)
    assert abs(mean - k) <= 5 * math.sqrt(var / len(draws)), (mean, var)
    # the "at most k" variant selects no more than k in expectation
    q = at_most_probs(x, k).double()
    draws = [approx_topk_at_most(x, k, generator=gen)[0].numel() for _ in range(200)]
    mq = sum(draws) / len(draws)
    assert mq <= k + 5 * math.sqrt(float((q * (1 - q)).sum()) / 200)
    assert abs(mq - float(q.sum())) <= 5 * math.sqrt(float((q * (1 - q)).sum()) / 200)


def test_sampling_output_and_seeds():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    i1, v1 = approx_topk(x, 100, seed=7)
    i2, v2 = approx_topk(x, 100, seed=7)
    i3, _ = approx_topk(x, 100, seed=8)
    assert torch.equal(i1, i2) and torch.equal(v1, v2) and not torch.equal(i1, i3)
    assert bool((i1[1:] > i1[:-1]).all()) and torch.equal(v1, x[i1])
    # the largest entries are (almost) always selected: p of the max is the largest probability
    p = approx_topk_probs(x, 100)
    assert int(p.argmax()) == int(x.abs().argmax())


def test_degenerate_inputs():
    z = torch.zeros(10)
    assert torch.allclose(approx_topk_probs(z, 3), torch.full((10,), 0.3))
    assert approx_topk_at_most(z, 3, seed=0)[0].numel() == 0
    assert torch.equal(approx_topk_probs(torch.randn(5), 5), torch.ones(5))
    assert approx_topk(torch.randn(5), 0, seed=0)[0].numel() == 0
    with pytest.raises(ValueError):
        approx_topk_probs(torch.randn(2, 2), 1)
    with pytest.raises(ValueError):
        approx_topk_probs(torch.randn(4), -1)


def test_bucketed_topk():
    x = torch.randn(1300, generator=torch.Generator().manual_seed(2))
    idx, vals = bucketed_topk(x, 4, 512)
    assert bool((idx[1:] > idx[:-1]).all()) and torch.equal(vals, x[idx])
    for b in range(3):
        lo, hi = b * 512, min(1300, (b + 1) * 512)
        mine = idx[(idx >= lo) & (idx < hi)]
        assert mine.numel() == 4  # fixed slot per bucket
        ref = torch.topk(x[lo:hi].abs(), 4).indices + lo
        assert set(mine.tolist()) == set(ref.tolist())
    # ragged last bucket smaller than kb: takes all of it, never the padding
    idx, _ = bucketed_topk(torch.randn(515), 8, 512)
    assert idx.numel() == 8 + 3 and int(idx.max()) < 515
    with pytest.raises(ValueError):
        bucketed_topk(x, 2, 0)


def test_bucketed_sample_probabilities_per_bucket():
    """The thesis' kernel: per bucket, Theorem 2.1's probabilities for kb expected selections."""
    x = torch.randn(1300, generator=torch.Generator().manual_seed(5), dtype=torch.float64) ** 3
    x[600:700] = 0.0
    x[520] = 1e4  # L-inf branch in bucket 1
    p = bucket_probs(x, 10, 512)
    assert p.shape == (3, 512) and float(p.min()) >= 0 and float(p.max()) <= 1
    for b in range(3):
        lo, hi = b * 512, min(1300, (b + 1) * 512)
        assert torch.allclose(p[b, : hi - lo], approx_topk_probs(x[lo:hi], 10), atol=1e-12)
        assert float(p[b, hi - lo:].abs().sum()) == 0.0  # the padding of the short bucket
    assert torch.allclose(p.sum(1), torch.full((3,), 10.0, dtype=torch.float64))


def test_bucketed_sample_fixed_count_pad_and_truncate():
    x = torch.randn(1300, generator=torch.Generator().manual_seed(2))
    gen = make_generator(4)
    counts = []
    for _ in range(50):
        idx, vals, real = bucketed_sample(x, 8, 512, generator=gen)
        assert bool((idx[1:] > idx[:-1]).all()) and int(idx.max()) < 1300
        assert torch.equal(vals[real], x[idx[real]]) and bool((vals[~real] == 0).all())
        for b in range(3):
            lo, hi = b * 512, min(1300, (b + 1) * 512)
            mine = (idx >= lo) & (idx < hi)
            assert int(mine.sum()) == 8  # exactly kb pairs per bucket (padded or truncated)
            counts.append(int((mine & real).sum()))
    # padding happens (fewer than kb sampled) and truncation happens (more sampled than kb) in this run
    assert min(counts) < 8 and max(counts) == 8
    # the same draws by hand: sampled positions in index order, truncated to kb, then padding slots
    small = torch.randn(40, generator=torch.Generator().manual_seed(3))
    idx, _, real = bucketed_sample(small, 5, 10, seed=6)
    sel = torch.rand((4, 10), generator=make_generator(6), dtype=torch.float64) < bucket_probs(small, 5, 10)
    want, want_real = [], []
    for b in range(4):
        picked = [b * 10 + j for j in range(10) if sel[b, j]][:5]
        pads = [b * 10 + j for j in range(10) if not sel[b, j]][: 5 - len(picked)]
        want += sorted(picked + pads)
        want_real += [i in picked for i in sorted(picked + pads)]
    assert idx.tolist() == want and real.tolist() == want_real


def test_bucketed_sample_expected_count_statistical():
    """Before padding/truncation, the sampled count per bucket has mean kb (sum of Bernoullis)."""
    x = torch.randn(2048, generator=torch.Generator().manual_seed(9)) ** 3
    p = bucket_probs(x, 16, 512)
    var = (p * (1 - p)).sum(1)
    gen = make_generator(11)
    tot = torch.zeros(4, dtype=torch.float64)
    trials = 300
    for _ in range(trials):
        sel = torch.rand(p.shape, generator=gen, dtype=p.dtype) < p
        tot += sel.sum(1)
    assert bool(((tot / trials - 16).abs() <= 5 * (var / trials).sqrt()).all())
