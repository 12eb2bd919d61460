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


@pytest.fixture(params=["default", "torch", "small_tiles", "torch_topk"])
def paths(request, monkeypatch):
    """"default": the C compaction when it builds here; "torch": the torch candidate pass;
    "small_tiles" (torch) sends small inputs through the sampled path, several tiles per row, odd tiles;
    "torch_topk": every input through ``torch.topk`` and the tie check (an accelerator's path below
    ``DEVICE_TOPK_BELOW``), here on the CPU."""
    if request.param == "torch_topk":
        monkeypatch.setattr(exact, "_takes_torch_topk", lambda X, k: True)
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
    # the torch pass keeps its tile workspace in scratch across calls; the C pass and torch.topk need none
    assert ("exact_topk_abs" in scratch) == (not native.enabled() and paths != "torch_topk")


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


def _edges(n: int) -> list[int]:
    """Positions where the kernel's pieces meet: the first and last index, the C pass's 64-element
    groups (and the remainder after the last whole group), the torch pass's 64-bit words and tiles."""
    per = -(-n // exact.CHUNK)
    step = -(-n // per)  # the torch pass's tile length (``_tiles``)
    last64 = n // 64 * 64  # first index of the remainder after the last whole 64-element group
    cuts = [0, 1, 63, 64, 65, 127, 128, last64 - 64, last64 - 1, last64, n - 65, n - 64, n - 63, n - 2, n - 1,
            step - 1, step, n - step, n - step - 1]
    return sorted({c for c in cuts if 0 <= c < n})


@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 1, (1 << 16) + 63, 40_001, 100_003])
def test_winners_at_the_last_index_and_at_64_element_boundaries(n, paths):
    # a small background and large entries exactly where the compaction's pieces meet: whatever
    # the sample sees, every one of them must be chosen (distinct magnitudes), and among equal
    # magnitudes there the lowest indices win (ties cut by k inside the planted group)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 1e-2
    edges = torch.tensor(_edges(n))
    e = edges.numel()
    sign = 1.0 - 2.0 * (torch.arange(e) % 2)
    x[edges] = sign * (1.0 + torch.arange(e, dtype=torch.float32).flip(0))
    for k in sorted({1, 2, e // 2, e - 1, e, e + 1, n // 100, n // 9}):
        got = topk_indices(x, k)
        assert torch.equal(got, oracle(x, k)), (n, k)
        if k >= e:
            assert set(edges.tolist()) <= set(got.tolist()), (n, k)
    assert topk_indices(x, 1).tolist() == [edges[0].item()] and n - 1 in topk_indices(x, e).tolist()
    x[edges] = sign * 2.0  # ties: the cut falls inside the planted group; the lowest indices win
    for k in sorted({1, e // 2, e - 1, e, n // 100}):
        got = topk_indices(x, k)
        assert torch.equal(got, oracle(x, k)), ("ties", n, k)
        if k <= e:
            assert got.tolist() == edges[:k].tolist(), ("ties", n, k)
        else:
            assert set(edges.tolist()) <= set(got.tolist()), ("ties", n, k)
    x.zero_()  # only the last index is non-zero: found by every path
    x[n - 1] = -5.0
    assert topk_indices(x, 1).tolist() == [n - 1]
    assert topk_indices(x, max(1, n // 100)).tolist()[-1] == n - 1


def test_rows_with_winners_at_row_ends_and_64_element_boundaries(paths):
    # the C pass runs per row (its 64-element groups restart at every row): plant at each row's
    # first and last column and at 64-multiples inside, with a row length that is not one
    m, bs = 3, 40_007
    X = torch.randn(m, bs, generator=torch.Generator().manual_seed(4)) * 1e-2
    cols = torch.tensor([0, 63, 64, 127, 128, bs // 64 * 64 - 1, bs // 64 * 64, bs - 2, bs - 1])
    for i in range(m):
        X[i, cols] = (3.0 + i) * (1.0 + torch.arange(cols.numel(), dtype=torch.float32))
    for k in (cols.numel(), bs // 100):
        got = topk_rows(X, k)
        assert torch.equal(got, torch.stack([oracle(X[i], k) for i in range(m)])), k
        assert all(set(cols.tolist()) <= set(row.tolist()) for row in got), k
    X[:, cols] = 7.0  # ties at the boundaries in every row: the lowest columns win
    got = topk_rows(X, 4)
    assert got.tolist() == [cols[:4].tolist()] * m


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


def test_torch_topk_path_dtypes_and_tie_fallback(monkeypatch):
    """:func:`torch_topk_rows` directly: low-precision dtypes with many ties, rows where only some
    tie at the k-th magnitude (those rows alone take the exact path) and a NaN row."""
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        x = (torch.randn(1, 60_000, generator=g) * 4).round().to(dtype)
        assert torch.equal(exact.torch_topk_rows(x, 600)[0], oracle(x[0], 600)), dtype
    X = torch.randn(5, 3000, generator=g)
    X[1, ::2] = 9.0  # 1500 ties above everything else: k = 30 cuts inside them
    X[3, 7] = float("nan")
    got = exact.torch_topk_rows(X, 30)
    assert torch.equal(got, torch.stack([oracle(X[i], 30) for i in range(5)]))
    assert got[1].tolist() == list(range(0, 60, 2))
    called, real = [], exact._exact_rows
    monkeypatch.setattr(exact, "_exact_rows", lambda A, k: called.append(A.shape[0]) or real(A, k))
    exact.torch_topk_rows(X, 30)
    assert called == [2]  # only the tied row and the NaN row
    for row in (1, 3):  # one row: ties at the k-th magnitude without NaN are finished among |x| >= it
        got = exact.torch_topk_rows(X[row:row + 1], 30)[0]
        assert torch.equal(got, oracle(X[row], 30))
    assert called == [2, 1]  # the NaN row alone took the exact path
    assert not exact._takes_torch_topk(X, 30)  # the CPU keeps its own paths


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
