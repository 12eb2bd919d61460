"""Exact top-k kernel (``select/exact.py``): the same set as ``torch.topk`` without ties, the documented
tie rule (lowest index wins; NaN ranks below every number) with ties, on every path of the kernel."""

import pytest
import torch

from sparsync import native
from sparsync.select import exact
from sparsync.select.exact import topk_indices, topk_rows, topk_select


def oracle(x: torch.Tensor, k: int) -> torch.Tensor:
    """The tie rule spelled out: stable sort by magnitude descending (NaN last), first k, by index."""
    a = x.abs().double().nan_to_num(nan=-1.0)
    return torch.sort(torch.sort(-a, stable=True).indices[:k]).values


def torch_set(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(torch.topk(x.abs(), k, sorted=False).indices).values


@pytest.fixture(params=["default", "torch", "small_tiles"])
def paths(request, monkeypatch):
    """"default": the C compaction when it builds here; "torch": the torch candidate pass;
    "small_tiles" (torch) sends small inputs through the sampled path, several tiles per row, odd tiles."""
    if request.param == "small_tiles":
        monkeypatch.setattr(exact, "CHUNK", 1001)
        monkeypatch.setattr(exact, "_MIN_ROW", 16)
        monkeypatch.setattr(exact, "_SAMPLE", 257)
    if request.param == "default":
        yield request.param
    else:
        with native.switched_off():
            yield request.param


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 63, 1000, 40_001, 100_003])
def test_same_set_as_torch_topk_without_ties(n, paths):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for k in sorted({0, 1, 2, n // 1000, n // 100, n // 10, n // 2, n - 1, n} & set(range(n + 1))):
        got = topk_indices(x, k)
        assert got.dtype == torch.int64
        want = torch_set(x, k) if k else torch.empty(0, dtype=torch.int64)
        assert torch.equal(got, want), (n, k)


def test_large_heavy_tailed_vector_equals_torch_topk(paths):
    g = torch.Generator().manual_seed(3)
    n = 1_000_003  # not a multiple of anything: odd last tile, strided sample with a remainder
    x = torch.randn(n, generator=g) * torch.exp(1.5 * torch.randn(n, generator=g))
    scratch = {}
    for k in (1, 1000, 10_000, 300_000):
        idx, vals = topk_select(x, k, scratch)
        assert torch.equal(idx, torch_set(x, k)) and torch.equal(vals, x[idx])
    # the torch pass keeps its tile workspace in scratch across calls; the C pass needs none
    assert ("exact_topk_abs" in scratch) == (not native.enabled())


@pytest.mark.parametrize("values", [[0.0], [1.0, -1.0], [0.0, 1.0, -2.0, 2.0, 3.0]])
def test_ties_follow_the_documented_rule(values, paths):
    g = torch.Generator().manual_seed(len(values))
    vals = torch.tensor(values)
    for n in (5, 999, 50_001):
        x = vals[torch.randint(0, len(values), (n,), generator=g)]
        for k in sorted({0, 1, n // 100, n // 3, n - 1, n}):
            got = topk_indices(x, k)
            assert torch.equal(got, oracle(x, k)), (values, n, k)
            assert torch.equal(topk_indices(x.clone(), k), got)  # deterministic


def test_all_zero_and_mostly_zero_inputs(paths):
    z = torch.zeros(70_000)
    assert torch.equal(topk_indices(z, 700), torch.arange(700))
    z[[5, 60_000, 69_999]] = torch.tensor([1.0, -3.0, 2.0])
    got = topk_indices(z, 700)
    assert torch.equal(got, oracle(z, 700))
    assert {5, 60_000, 69_999} <= set(got.tolist()) and got[0] == 0


def test_nan_ranks_below_every_number_and_inf_above(paths):
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(1))
    x[::7] = float("nan")
    x[10] = float("inf")
    x[11] = -float("inf")
    for k in (1, 2, 100, 40_000, 45_000, 50_000):
        got = topk_indices(x, k)
        assert torch.equal(got, oracle(x, k)), k
    assert topk_indices(x, 2).tolist() == [10, 11]


def test_unlucky_sample_falls_back_to_the_exact_path(monkeypatch):
    # large entries only where the strided sample never looks: the sample sees only small values
    monkeypatch.setattr(exact, "_SAMPLE", 1000)
    n = 100_000
    x = torch.rand(n, generator=torch.Generator().manual_seed(2)) * 1e-3
    stride = n // 1000
    big = torch.arange(n)[torch.arange(n) % stride != 0][:5000]
    x[big] = 1.0 + torch.rand(5000, generator=torch.Generator().manual_seed(3))
    got = topk_indices(x, 3000)
    assert torch.equal(got, torch_set(x, 3000))


@pytest.mark.parametrize("m,bs", [(1, 50_000), (3, 40_000), (7, 5003), (40, 100), (2, 3)])
def test_rows_equal_per_row_selection(m, bs, paths):
    g = torch.Generator().manual_seed(m * bs)
    X = torch.randn(m, bs, generator=g)
    if m > 2:
        X[1] = 0.0  # an all-zero row (exact path for that row only)
        X[2, ::3] = 0.5  # ties in another row
    for k in sorted({1, bs // 100, bs // 10, bs - 1, bs} - {0}):
        got = topk_rows(X, k)
        assert got.shape == (m, k)
        want = torch.stack([oracle(X[i], k) for i in range(m)])
        assert torch.equal(got, want), (m, bs, k)


def test_dtypes_and_noncontiguous_rows():
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        x = (torch.randn(60_000, generator=g) * 4).round().to(dtype)  # low precision: many ties
        assert torch.equal(topk_indices(x, 600), oracle(x, 600)), dtype
    X = torch.randn(50_000, 4, generator=g).t()  # rows not contiguous
    assert torch.equal(topk_rows(X, 500), torch.stack([oracle(X[i], 500) for i in range(4)]))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="k must be in"):
        topk_indices(torch.randn(10), 11)
    with pytest.raises(ValueError, match="k must be in"):
        topk_indices(torch.randn(10), -1)
    with pytest.raises(ValueError, match="k must be an integer"):
        topk_indices(torch.randn(10), 2.5)
    with pytest.raises(ValueError, match="1-D"):
        topk_indices(torch.randn(2, 5), 1)
    with pytest.raises(ValueError, match="2-D"):
        topk_rows(torch.randn(5), 1)
    with pytest.raises(TypeError, match="floating-point"):
        topk_rows(torch.ones(2, 5, dtype=torch.int64), 1)
    assert topk_rows(torch.randn(0, 5), 2).shape == (0, 2)


def test_bench_select_exact_part(capsys):
    from sparsync.cli import main

    assert main(["bench-select", "--parts", "exact", "--sizes", "5e4", "--densities", "0.01", "--repeat", "1"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| 5e+04 | 0.01 | 500 |") and row.endswith("| True |")
