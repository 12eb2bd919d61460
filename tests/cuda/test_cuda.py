"""CUDA: the selection kernels and the count sketch on CUDA tensors give what they give on the CPU.

Every kernel runs on a CUDA tensor and on its CPU copy, and the two results must be equal - bitwise
where the algorithm is deterministic (index sets, the sketch's integer hashes, integer-valued sums);
the exact top-k's set must also equal ``torch.topk``'s on the same CUDA tensor, and follow the
documented tie rule (``tests/selection/test_exact_topk.py``'s oracle). Marked ``cuda``: ``conftest.py`` skips
these where torch sees no GPU (CPU-only CI). The gloo-process tests are in ``test_cuda_gloo.py``.
"""

import pytest
import torch
from selection.test_exact_topk import oracle, torch_set

from sparsync.select.approx import bucketed_topk
from sparsync.select.blocks import block_norms, block_topk
from sparsync.select.exact import topk_indices, topk_rows, topk_select
from sparsync.select.threshold import (
    Workspace,
    calibration_edges,
    choose_edge,
    keep_largest,
    local_histogram,
    partitioned_threshold_select,
    threshold_indices,
    threshold_select,
)
from sparsync.sketch import CountSketch, block_bitmap, block_elements, blocks_from_bitmap, median_rows
from sparsync.sparse import SparseVec, add_at, coalesce_in_order, sum_streams
from sparsync.spardl.blocksel import topk_det

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _heavy(n: int, seed: int) -> torch.Tensor:
    """A heavy-tailed CPU vector (no ties in practice)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(1.5 * torch.randn(n, generator=g))


def _ties(n: int, seed: int, values=(0.0, 1.0, -1.0, 2.0, -3.0)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor(values)[torch.randint(0, len(values), (n,), generator=g)]


# ---------------------------------------------------------------------- exact top-k
@pytest.mark.parametrize("n", [1000, 40_001, 1_000_003])
def test_exact_topk_equals_torch_topk_and_the_cpu(n):
    x = _heavy(n, n)
    xc = x.to(DEV)
    scratch = {}
    for k in sorted({1, n // 1000, n // 100, n // 10, n // 2} - {0}):
        idx, vals = topk_select(xc, k, scratch)
        assert idx.device.type == DEV and idx.dtype == torch.int64
        assert torch.equal(idx, torch_set(xc, k)), (n, k)  # torch.topk on the same CUDA tensor
        assert torch.equal(idx.cpu(), topk_indices(x, k)), (n, k)
        assert torch.equal(vals, xc[idx])


@pytest.mark.parametrize("n", [999, 50_001, 300_007])
def test_exact_topk_ties_nan_inf_follow_the_rule_on_cuda(n):
    x = _ties(n, n)
    x[n // 3] = float("nan")
    x[n // 2] = float("inf")
    x[n - 1] = -float("inf")
    xc = x.to(DEV)
    for k in sorted({1, n // 100, n // 3, n - 2}):
        got = topk_indices(xc, k)
        assert torch.equal(got.cpu(), oracle(x, k)), (n, k)
        assert torch.equal(topk_indices(xc.clone(), k), got)  # deterministic
    z = torch.zeros(70_000, device=DEV)
    assert torch.equal(topk_indices(z, 700).cpu(), torch.arange(700))


@pytest.mark.parametrize("shape,k", [((4, 40_000), 400), ((64, 1000), 10), ((3, 100_003), 1000), ((16, 4096), 2048)])
def test_per_block_topk_rows_equal_the_cpu(shape, k):
    """SparDL's per-block selection (:func:`topk_rows`, all rows at once) with and without ties."""
    m, bs = shape
    for X in (_heavy(m * bs, bs).view(m, bs), _ties(m * bs, bs).view(m, bs)):
        got = topk_rows(X.to(DEV), k)
        assert got.device.type == DEV and got.shape == (m, k)
        want = torch.stack([oracle(row, k) for row in X])
        assert torch.equal(got.cpu(), want)
        assert torch.equal(got.cpu(), topk_rows(X, k))


def test_deterministic_topk_of_a_sparse_list():
    idx = torch.arange(0, 30_000, 3)
    vals = _ties(idx.numel(), 5)
    want = topk_det(idx, vals, 1234)
    got = topk_det(idx.to(DEV), vals.to(DEV), 1234)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


# ---------------------------------------------------------------------- threshold, MiCRO
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_threshold_selection_equals_the_cpu(dtype):
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[3], x[4], x[5] = 0.5, -0.5, float("nan")
    xc = x.to(DEV)
    ws = Workspace()
    for d in (0.5, 2.0, 4.5):
        got = threshold_indices(xc, d, workspace=ws)
        assert got.device.type == DEV and got.dtype == torch.int64
        assert torch.equal(got.cpu(), threshold_indices(x, d))
        assert torch.equal(got.cpu(), torch.nonzero(x.abs() >= d).squeeze(1))
    idx, vals = threshold_select(xc, 2.0)
    assert torch.equal(vals, xc[idx])
    for s, e, cap in ((0, 1_000_003, None), (17, 500_000, 100), (250_000, 750_000, 5)):
        gi, gp = partitioned_threshold_select(xc, 1.0, s, e, cap=cap, workspace=ws)
        ci, cp = partitioned_threshold_select(x, 1.0, s, e, cap=cap)
        assert gp == cp and torch.equal(gi.cpu(), ci)
    a = x.abs().nan_to_num(0.0)
    assert torch.equal(keep_largest(torch.arange(x.numel(), device=DEV), a.to(DEV), 999).cpu(),
                       keep_largest(torch.arange(x.numel()), a, 999))


def test_micro_histogram_path_equals_the_cpu():
    """MiCRO's calibration: log-spaced edges, the bucket of every candidate, the chosen edge."""
    g = torch.Generator().manual_seed(2)
    v = (torch.randn(400_000, generator=g) * 0.01).abs()
    v[:3] = torch.tensor([0.0, float("inf"), 1e-30])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        e_cpu = calibration_edges(0.01, 1.5, 64, dtype)
        e_gpu = calibration_edges(0.01, 1.5, 64, dtype, DEV)
        assert e_gpu.device.type == DEV and torch.equal(e_gpu.cpu(), e_cpu)
        vv = v.to(dtype)
        hist, bucket = local_histogram(vv.to(DEV), e_gpu)
        h_cpu, b_cpu = local_histogram(vv, e_cpu)
        assert torch.equal(hist.cpu(), h_cpu) and torch.equal(bucket.cpu(), b_cpu)
        assert torch.equal(bucket.cpu(), torch.bucketize(vv, e_cpu, right=True))
        for target in (0, 100, 4000, 10**7):
            assert choose_edge(hist, target) == choose_edge(h_cpu, target)


def test_sparcml_bucketed_topk_equals_the_cpu():
    x = _heavy(100_003, 4)
    for kb in (1, 5, 512):
        gi, gv = bucketed_topk(x.to(DEV), kb)
        ci, cv = bucketed_topk(x, kb)
        assert torch.equal(gi.cpu(), ci) and torch.equal(gv.cpu(), cv)


# ---------------------------------------------------------------------- count sketch (S2)
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_count_sketch_equals_the_cpu(rows):
    """Hashes bitwise; integer-valued values so every sum is exact whatever the order of additions:
    tables and median queries bitwise; precomputed tables hash identically."""
    g = torch.Generator().manual_seed(rows)
    idx = torch.randint(0, 10**9, (50_000,), generator=g)
    idx[:1000] = idx[1000:2000]  # repeated indices add up
    vals = torch.randint(-50, 51, (50_000,), generator=g).float()
    cpu, gpu = CountSketch(rows, 997, seed=5), CountSketch(rows, 997, seed=5, device=DEV)
    ic, vc = idx.to(DEV), vals.to(DEV)
    assert torch.equal(gpu.buckets(ic).cpu(), cpu.buckets(idx)) and torch.equal(gpu.signs(ic).cpu(), cpu.signs(idx))
    tg, tc = gpu.encode(ic, vc), cpu.encode(idx, vals)
    assert tg.device.type == DEV and torch.equal(tg.cpu(), tc)
    assert torch.equal(gpu.query(tg, ic).cpu(), cpu.query(tc, idx))
    assert gpu.collisions(ic) == cpu.collisions(idx)
    small = idx % 100_000
    gpu.precompute(100_000)
    cpu.precompute(100_000)
    assert torch.equal(gpu.encode(small.to(DEV), vc).cpu(), cpu.encode(small, vals))
    # float values: equal up to the order of additions; run twice on CUDA: bitwise the same
    fv = torch.randn(50_000, generator=g)
    a, b = gpu.encode(small.to(DEV), fv.to(DEV)), gpu.encode(small.to(DEV), fv.to(DEV))
    assert torch.equal(a, b), "CUDA sketch encode is not deterministic"
    assert torch.allclose(a.cpu(), cpu.encode(small, fv), atol=1e-4)
    est = torch.randn(rows, 1000, generator=g)
    assert torch.equal(median_rows(est.to(DEV)).cpu(), median_rows(est))


def test_sketch_from_cuda_tables():
    buckets = torch.tensor([[0, 1, 0, 2], [2, 2, 1, 0]], device=DEV)
    signs = torch.tensor([[1, -1, 1, 1], [-1, 1, 1, -1]], device=DEV)
    sk = CountSketch.from_tables(buckets, signs, 3)
    t = sk.encode(torch.arange(4, device=DEV), torch.tensor([1.0, 2.0, 3.0, 4.0], device=DEV))
    assert t.device.type == DEV
    assert t.cpu().tolist() == [[4.0, -2.0, 4.0], [-4.0, 3.0, 1.0]]


def test_block_norms_topk_and_bitmap_equal_the_cpu():
    x = _heavy(100_003, 7)  # the last block is short
    xc = x.to(DEV)
    assert torch.allclose(block_norms(xc, 256).cpu(), block_norms(x, 256), rtol=1e-5)
    gi, gidx, gv = block_topk(xc, 40, 256)
    ci, cidx, cv = block_topk(x, 40, 256)
    assert torch.equal(gi.cpu(), ci) and torch.equal(gidx.cpu(), cidx) and torch.equal(gv.cpu(), cv)
    ids = torch.tensor([0, 5, 5, 390], device=DEV)
    bm = block_bitmap(ids, 391)
    assert bm.device.type == DEV and torch.equal(blocks_from_bitmap(bm).cpu(), torch.tensor([0, 5, 390]))
    assert torch.equal(block_elements(blocks_from_bitmap(bm), 256, 100_003).cpu(),
                       block_elements(torch.tensor([0, 5, 390]), 256, 100_003))


# ---------------------------------------------------------------------- sums with repeated indices
def test_sums_with_repeated_indices_follow_the_input_order():
    """Every index gets ``0 + v_0 + v_1 + ...`` in input order (what lets every rank sum the same
    list to the same bits): on CUDA bitwise what the CPU gives, and the same on every call."""
    g = torch.Generator().manual_seed(9)
    numel, P = 2000, 8
    idx = [torch.randperm(numel, generator=g)[:1200].sort().values for _ in range(P)]
    vals = [torch.randn(1200, generator=g) * 10.0 ** torch.randint(-4, 5, (1200,), generator=g) for _ in range(P)]
    cu, cv = coalesce_in_order(idx, vals, numel)
    for _ in range(2):
        gu, gv = coalesce_in_order([i.to(DEV) for i in idx], [v.to(DEV) for v in vals], numel)
        assert torch.equal(gu.cpu(), cu) and torch.equal(gv.cpu(), cv)
    flat_i, flat_v = torch.cat(idx), torch.cat(vals)
    want = add_at(torch.zeros(numel), flat_i, flat_v)
    assert torch.equal(add_at(torch.zeros(numel, device=DEV), flat_i.to(DEV), flat_v.to(DEV)).cpu(), want)
    sv = SparseVec.coalesce(flat_i.to(DEV), flat_v.to(DEV), numel)
    assert torch.equal(sv.values.cpu(), SparseVec.coalesce(flat_i, flat_v, numel).values)
    parts = [SparseVec(i, v, numel) for i, v in zip(idx, vals)]
    want = sum_streams(parts, numel)
    got = sum_streams([SparseVec(i.to(DEV), v.to(DEV), numel) for i, v in zip(idx, vals)], numel)
    assert torch.equal(got.to_dense().cpu() if isinstance(got, SparseVec) else got.cpu(),
                       want.to_dense() if isinstance(want, SparseVec) else want)
