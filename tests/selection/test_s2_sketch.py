"""Count sketch, bitmap and block top-K (S2 Reducer, Ge et al., §2-§4): exactness without collisions,
unbiasedness of the single-row sketch over seeds, median error shrinking with columns, exact bitmap,
padding rule, bad input."""

import itertools
import math

import pytest
import torch

from sparsync.select.blocks import block_norms, block_topk, blocks_for_density, num_blocks
from sparsync.sketch import (
    CountSketch,
    block_bitmap,
    block_elements,
    blocks_from_bitmap,
    median_rows,
    sketch_columns,
)


def _free_seed(idx, rows, columns, start=0):
    """The first seed whose hashes put every index of ``idx`` in its own bucket in every row."""
    for seed in range(start, start + 5000):
        if CountSketch(rows, columns, seed).collisions(idx) == 0:
            return seed
    raise AssertionError("no collision-free seed found")


# ---------------------------------------------------------------------- hashes
def test_hashes_are_a_function_of_the_seed_only():
    idx = torch.randint(0, 10**9, (1000,))
    a, b, c = CountSketch(3, 97, seed=7), CountSketch(3, 97, seed=7), CountSketch(3, 97, seed=8)
    assert torch.equal(a.buckets(idx), b.buckets(idx)) and torch.equal(a.signs(idx), b.signs(idx))
    assert not torch.equal(a.buckets(idx), c.buckets(idx))
    h = a.buckets(idx)
    assert int(h.min()) >= 0 and int(h.max()) < 97
    s = a.signs(idx)
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    # balanced signs and roughly uniform buckets over many indices
    big = torch.arange(200_000)
    assert abs(float(a.signs(big).mean())) < 0.01
    counts = torch.bincount(a.buckets(big)[0], minlength=97).float()
    assert float(counts.std() / counts.mean()) < 0.05


def test_sketch_is_linear():
    sk = CountSketch(3, 50, seed=1)
    i1, i2 = torch.randint(0, 1000, (80,)), torch.randint(0, 1000, (60,))
    v1, v2 = torch.randn(80, dtype=torch.float64), torch.randn(60, dtype=torch.float64)
    both = sk.encode(torch.cat([i1, i2]), torch.cat([v1, v2]))
    assert torch.allclose(sk.encode(i1, v1) + sk.encode(i2, v2), both, atol=1e-12)


# ---------------------------------------------------------------------- exactness without collisions
@pytest.mark.parametrize("rows", [1, 3])
def test_no_collisions_means_exact(rows):
    g = torch.Generator().manual_seed(3)
    idx = torch.randperm(100_000, generator=g)[:40]
    vals = torch.randn(40, generator=g)
    cols = 8 * idx.numel()  # at least as large as the nonzeros (and roomy enough to find a free seed)
    seed = _free_seed(idx, rows, cols)
    sk = CountSketch(rows, cols, seed)
    assert torch.equal(sk.query(sk.encode(idx, vals), idx), vals)  # bitwise: each bucket holds one value
    # elements not in the sketch, whose buckets are free in every row, read 0 exactly
    other = torch.arange(100_000, 100_200)
    est = sk.query(sk.encode(idx, vals), other)
    hit = (sk.buckets(other).unsqueeze(-1) == sk.buckets(idx).unsqueeze(1)).any(-1).any(0)
    assert torch.equal(est[~hit], torch.zeros(int((~hit).sum())))


def test_collision_counter_detects_collisions():
    idx = torch.arange(50)
    assert CountSketch(1, 10, 0).collisions(idx) > 0  # pigeonhole
    assert CountSketch(2, 10, 0).collisions(idx) >= 2 * (50 - 10)


# ---------------------------------------------------------------------- statistics
def test_single_row_estimate_is_unbiased_over_seeds():
    """E[est_i] = g_i over the random hashes; tolerance from Var[est_i] = sum_{k!=i} g_k^2 / c."""
    gen = torch.Generator().manual_seed(0)
    m, c, T = 64, 16, 2000
    idx = torch.randperm(10**6, generator=gen)[:m]
    g = (1.0 + torch.rand(m, generator=gen, dtype=torch.float64))  # positive: a sign bug would bias upwards
    g[:4] *= 10  # a few heavy entries
    probe = torch.cat([idx, torch.tensor([10**6 + 1, 10**6 + 2])])  # + two zero coordinates
    truth = torch.cat([g, torch.zeros(2, dtype=torch.float64)])
    est = torch.stack([CountSketch(1, c, seed).query(CountSketch(1, c, seed).encode(idx, g), probe)
                       for seed in range(T)])
    sq = (g * g).sum()
    var = (sq - truth * truth) / c  # collisions with every other non-zero, probability 1/c each
    z = (est.mean(0) - truth) / torch.sqrt(var / T)
    assert float(z.abs().max()) < 4.5, z
    assert abs(float(z.mean())) < 4.5 / math.sqrt(z.numel())  # no common drift either
    # and the variance itself is what the derivation says (within sampling + mod-c non-uniformity)
    ratio = est.var(0) / var
    assert 0.8 < float(ratio.mean()) < 1.2
    # control: the estimator is far from exact at this size (so the test above is not vacuous)
    assert float((est - truth).abs().mean()) > 0.5


def test_median_error_shrinks_as_columns_grow():
    gen = torch.Generator().manual_seed(1)
    m = 2000
    g = torch.distributions.StudentT(2.0).sample((m,))  # heavy tailed
    idx = torch.randperm(10**6, generator=gen)[:m]
    sweep = [50, 100, 200, 400, 800, 1600, 3200]
    for rows in (1, 5):
        errs = []
        for c in sweep:
            e = 0.0
            for seed in range(8):
                sk = CountSketch(rows, c, seed)
                e += float((sk.query(sk.encode(idx, g), idx) - g).norm() / g.norm())
            errs.append(e / 8)
        assert all(b < a for a, b in itertools.pairwise(errs)), (rows, errs)
        assert errs[-1] < errs[0] / 5, (rows, errs)
    # more rows help at equal columns (the median concentrates)
    sk1, sk5 = CountSketch(1, 800, 0), CountSketch(5, 800, 0)
    e1 = (sk1.query(sk1.encode(idx, g), idx) - g).norm()
    e5 = (sk5.query(sk5.encode(idx, g), idx) - g).norm()
    assert e5 < e1


def test_even_rows_use_the_mean_of_the_middle_pair():
    sk = CountSketch(4, 3, seed=5)
    idx = torch.arange(10)
    table = sk.encode(idx, torch.randn(10))
    est = sk.estimates(table, idx).sort(0).values
    assert torch.equal(sk.query(table, idx), (est[1] + est[2]) / 2)


# ---------------------------------------------------------------------- bitmap
def test_summed_bitmap_is_exactly_the_union():
    gen = torch.Generator().manual_seed(2)
    b, P = 500, 7
    per_rank = [torch.randint(0, b, (int(torch.randint(0, 40, (1,), generator=gen)),), generator=gen)
                for _ in range(P)]
    summed = sum(block_bitmap(ids, b) for ids in per_rank)
    union = torch.unique(torch.cat(per_rank))
    assert torch.equal(blocks_from_bitmap(summed), union)
    counts = torch.zeros(b)
    for ids in per_rank:
        counts[torch.unique(ids)] += 1
    assert torch.equal(summed, counts)  # one count per rank that touched the block
    assert torch.equal(blocks_from_bitmap(torch.zeros(b)), torch.empty(0, dtype=torch.int64))


# ---------------------------------------------------------------------- block top-K and padding
def test_block_topk_picks_largest_norm_blocks_and_pads_the_tail():
    n, bs = 1003, 64  # 16 blocks, the last holds 43 elements (zero padded to 64)
    x = torch.randn(n) * 0.01
    x[-5:] = 100.0  # the short tail block has the largest norm
    x[128:192] = 3.0  # block 2 second
    assert num_blocks(n, bs) == 16
    norms = block_norms(x, bs)
    ref = torch.cat([x, torch.zeros(16 * bs - n)]).view(16, bs).norm(dim=1)
    assert torch.allclose(norms, ref)
    ids, idx, vals = block_topk(x, 2, bs)
    assert ids.tolist() == [2, 15]
    assert torch.equal(idx, torch.cat([torch.arange(128, 192), torch.arange(960, 1003)]))
    assert torch.equal(vals, x[idx])
    assert block_elements(torch.tensor([15]), bs, n).max() == n - 1


def test_blocks_for_density():
    assert blocks_for_density(100, 1 / 32) == 3
    assert blocks_for_density(100, 1e-6) == 1
    assert blocks_for_density(100, 1.0) == 100


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw", [{"columns": 0}, {"columns": -1}, {"ratio": 0}, {"ratio": -0.5},
                                {"ratio": float("nan")}, {"columns": 4, "ratio": 0.5}, {"rows": 0},
                                {"columns": 2.5}])
def test_bad_sketch_sizes(kw):
    with pytest.raises(ValueError):
        sketch_columns(100, **kw)


def test_sketch_needs_one_column():
    with pytest.raises(ValueError, match="at least 1 column"):
        CountSketch(1, 0)
    assert sketch_columns(1, rows=1, ratio=1e-9) == 1  # a tiny positive ratio rounds up to one column
    with pytest.raises(ValueError):
        CountSketch(1, 4).encode(torch.arange(3), torch.ones(4))


def test_precomputed_tables_hash_identically():
    a, b = CountSketch(3, 1000, 5), CountSketch(3, 1000, 5)
    b.precompute(100_000)
    i = torch.randint(0, 100_000, (5000,))
    assert torch.equal(a.buckets(i), b.buckets(i)) and torch.equal(a.signs(i), b.signs(i))
    v = torch.randn(5000)
    assert torch.equal(a.query(a.encode(i, v), i), b.query(b.encode(i, v), i))
    with pytest.raises(IndexError):
        b.buckets(torch.tensor([100_000]))


@pytest.mark.parametrize("r", range(1, 12))
def test_median_rows_matches_sort(r):
    e = torch.randn(r, 777)
    e[:, :5] = 1.0  # ties
    s = e.sort(0).values
    ref = s[r // 2] if r % 2 else (s[r // 2 - 1] + s[r // 2]) / 2
    assert torch.equal(median_rows(e), ref)
