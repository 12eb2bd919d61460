"""Threshold selection kernels, MiCRO partitions, calibration and the threshold controller."""

import math

import pytest
import torch

from sparsync.select.threshold import (
    ThresholdController,
    Workspace,
    calibration_edges,
    check_threshold,
    choose_edge,
    initial_threshold,
    keep_largest,
    local_histogram,
    owned_partition,
    partition_bounds,
    partition_owner,
    partitioned_threshold_select,
    threshold_indices,
    threshold_select,
)


def naive(x, d):
    return torch.nonzero(x.abs() >= d).squeeze(1)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 1000, 4097])
@pytest.mark.parametrize("chunk", [2, 6, 1024, 1 << 20])
def test_threshold_indices_matches_naive(n, chunk, kernel):
    g = torch.Generator().manual_seed(n * 31 + chunk)
    x = torch.randn(n, generator=g)
    if n > 4:
        x[3] = 0.5  # exactly on the threshold: selected (>=)
        x[4] = -0.5
    for d in (0.5, 1.5, 10.0):
        got = threshold_indices(x, d, chunk=chunk)
        assert got.dtype == torch.int64
        assert torch.equal(got, naive(x, d))


def test_threshold_indices_offset_workspace_and_views(kernel):
    x = torch.randn(10_001)
    ws = Workspace()
    for s, e in [(0, 10_001), (1, 5000), (3333, 10_001), (17, 18)]:
        got = threshold_indices(x[s:e], 1.0, workspace=ws, offset=s, chunk=1000)
        assert torch.equal(got, naive(x[s:e], 1.0) + s)
    # other dtypes take the plain path and agree too
    for dt in (torch.float64, torch.float16, torch.bfloat16):
        y = x.to(dt)
        assert torch.equal(threshold_indices(y, 1.0), naive(y, 1.0))
    idx, vals = threshold_select(x, 2.0)
    assert torch.equal(vals, x[idx])


def test_nan_and_inf(kernel):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.1, -3.0])
    assert threshold_indices(x, 1.0).tolist() == [1, 2, 4]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "x", None])
def test_bad_threshold(bad):
    with pytest.raises(ValueError):
        check_threshold(bad)
    with pytest.raises(ValueError):
        threshold_indices(torch.ones(4), bad)


def test_bad_input_tensor():
    with pytest.raises(ValueError):
        threshold_indices(torch.ones(2, 2), 1.0)
    with pytest.raises(TypeError):
        threshold_indices(torch.ones(4, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError):
        initial_threshold(0)


def test_partitions_worked_example():
    # hand-worked example §8.1: n = 4, n_g = 10
    assert partition_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    table = {0: [0, 1, 2, 3], 1: [1, 2, 3, 0], 2: [2, 3, 0, 1], 3: [3, 0, 1, 2], 4: [0, 1, 2, 3]}
    for t, parts in table.items():
        assert [owned_partition(i, t, 4) for i in range(4)] == parts
        assert [partition_owner(p, t, 4) for p in parts] == [0, 1, 2, 3]
    for n, P in [(0, 3), (5, 8), (1001, 7)]:
        b = partition_bounds(n, P)
        assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(P - 1))
        assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1
    with pytest.raises(ValueError):
        partition_bounds(10, 0)


def test_worked_example_selection():
    # hand-worked example §8.2, t = 1, delta = 1.0
    acc = {
        0: [0.2, -1.5, 0.3, 0.9, 0.1, 1.2, -0.4, 0.0, 2.0, 0.5],
        1: [1.1, 0.2, -0.3, -1.8, 0.6, 0.1, 0.7, -1.0, 0.2, 0.1],
        2: [-0.6, 0.4, 1.3, 0.2, -0.2, 0.3, 1.6, 0.4, -0.9, 1.2],
        3: [0.3, -1.3, 0.2, 1.4, -1.1, 0.5, 0.1, -0.7, 0.4, -2.5],
    }
    bounds = partition_bounds(10, 4)
    sel = {}
    for w, a in acc.items():
        s, e = bounds[owned_partition(w, 1, 4)]
        sel[w] = partitioned_threshold_select(torch.tensor(a), 1.0, s, e)[0].tolist()
    assert sel == {0: [5], 1: [7], 2: [9], 3: [1]}


def test_partition_cap_keeps_largest():
    x = torch.tensor([0.0, 5.0, -6.0, 1.0, 7.0, -1.5, 2.0])
    idx, passed = partitioned_threshold_select(x, 1.0, 1, 7, cap=2)
    assert passed == 6 and idx.tolist() == [2, 4]
    assert keep_largest(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), 5).tolist() == [1, 2]
    with pytest.raises(ValueError):
        partitioned_threshold_select(x, 1.0, 5, 9)


def test_calibration_histogram_counts_are_exact(kernel):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(5000, generator=g).abs()
    edges = calibration_edges(1.0, 1.5, 64)
    assert edges.numel() == 65 and bool((edges[1:] > edges[:-1]).all())
    cand = v[v >= edges[0]]
    hist, bucket = local_histogram(cand, edges)
    counts = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])[1:]
    for j in range(65):
        assert int(counts[j]) == int((cand >= edges[j]).sum())
        assert int((bucket > j).sum()) == int((cand >= edges[j]).sum())
    for target in (0, 10, 300, 10**6):
        j, c = choose_edge(hist, target)
        assert c == int(counts[j])
        assert abs(c - target) == int((counts - target).abs().min())
    # nothing in the window: take the lowest edge (move down); everything above: the highest
    empty = torch.zeros(66, dtype=torch.int64)
    assert choose_edge(empty, 100)[0] == 0
    top = torch.zeros(66, dtype=torch.int64)
    top[-1] = 1000
    assert choose_edge(top, 100)[0] == 64
    with pytest.raises(ValueError):
        calibration_edges(1.0, 1.0, 8)


def test_controller_authors_rule_trace():
    # hand-worked example §8.3 (k = 1000)
    c = ThresholdController(1000, initial_threshold(1000), rule="micro")
    assert c.delta == pytest.approx(0.015811, abs=1e-6)
    assert c.update(5000) == pytest.approx(0.015890, abs=1e-6)
    assert c.update(3000) == pytest.approx(0.015970, abs=1e-6)
    d = c.delta
    assert c.update(1000) == pytest.approx(d * 1.00125)
    assert c.update(500) == pytest.approx(d * 1.00125 * 0.995)


def _model_count(delta, scale):
    """Count of a smooth heavy-tailed population above delta (steady-state-like response)."""
    return int(100_000 * min(1.0, (scale / delta) ** 1.5))


@pytest.mark.parametrize("rule", ["adaptive", "proportional"])
def test_controller_converges_from_far(rule):
    target = 1000
    for scale in (1e-4, 1e2):  # the initial threshold is off by ~100x either way
        c = ThresholdController(target, 0.0158, rule=rule, gamma=0.5)
        hist = []
        for _ in range(80):
            cnt = _model_count(c.delta, scale * 0.0158 / 21.5)
            hist.append(cnt)
            c.update(cnt)
        assert all(abs(h / target - 1) <= 0.1 for h in hist[-20:]), (rule, scale, hist[-20:])


def test_controller_state_and_bad_args():
    c = ThresholdController(100, 0.5)
    for cnt in (0, 0, 500, 90, 120):
        c.update(cnt)
    c2 = ThresholdController(100, 1.0)
    c2.load_state_dict(c.state_dict())
    for cnt in (80, 300, 100, 0):
        assert c.update(cnt) == c2.update(cnt)
    for kw in ({"rule": "nope"}, {"gamma": 0}, {"max_step": 1.0}, {"band": 1.0}, {"min_step": 0},
               {"grow": 0.5}, {"shrink": 1.0}):
        with pytest.raises(ValueError):
            ThresholdController(100, 0.5, **kw)
    with pytest.raises(ValueError):
        ThresholdController(0, 0.5)
    with pytest.raises(ValueError):
        ThresholdController(10, -1.0)
    assert "ThresholdController" in repr(c)
    assert math.isfinite(c.delta)
