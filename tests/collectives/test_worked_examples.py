"""the hand-worked examples §5-§8 as exact tests: every number of the example is asserted, so a
change of any one of them fails.

Numbers printed in the spec with fewer digits than a float carries are compared at the printed
precision (half a unit of the last printed digit); everything else is compared exactly (or to
``1e-12`` where the example's sum is not representable in binary floating point).
"""

import pytest
import torch

import sparsync as ss
from sparsync import sparse as sp
from sparsync.collectives.sparcml_common import expected_union
from sparsync.reducers.s2 import S2Reducer
from sparsync.schedule.merge import (
    brute_force,
    evaluate,
    optimal_table,
    plan_mgwfbp,
    plan_optimal,
    plan_single,
    plan_wfbp,
)
from sparsync.select.threshold import ThresholdController, initial_threshold
from sparsync.sketch import CountSketch, block_bitmap, median_rows
from sparsync.sparse import SparseVec

# ====================================================================== §7 S2 count sketch
S2_A = {2: 0.5, 3: -1.0, 6: 2.0, 7: 0.25, 10: -0.75}
S2_B = {6: 1.0, 7: -0.5, 8: 0.3, 9: 0.2}
S2_SKETCH_A = [[0.0, -0.5, -1.0, 0.5], [-2.25, 0.0, 2.0, 0.25], [0.0, 0.0, -2.0, -1.0]]
S2_SKETCH_B = [[0.3, -0.5, -1.2, 0.0], [0.2, 0.0, 1.0, -0.8], [-0.5, 0.2, -1.0, 0.3]]
S2_SKETCH_SUM = [[0.3, -1.0, -2.2, 0.5], [-2.05, 0.0, 3.0, -0.55], [-0.5, 0.2, -3.0, -0.7]]
# i: (row estimates, median) for worker A alone
S2_QUERY_A = {2: ([0.5, 2.25, 0.0], 0.5), 3: ([1.0, -2.25, -1.0], -1.0), 6: ([1.0, 2.0, 2.0], 2.0),
              7: ([-0.5, 0.25, 0.0], 0.0), 10: ([-0.5, -2.25, 0.0], -0.5), 11: ([0.0, 0.0, 2.0], 0.0)}
S2_MEDIANS_SUM = {2: 0.5, 3: -0.7, 6: 3.0, 7: -0.55, 8: 0.3, 9: 0.2, 10: -1.0, 11: 0.0}


def _s2_example_sketch() -> CountSketch:
    """The example's hash functions: ``h_j(i) = ((a_j i + b_j) mod 13) mod 4``, sign from parity."""
    i = torch.arange(12)
    h = torch.stack([((a * i + b) % 13) % 4 for a, b in [(3, 1), (5, 2), (7, 3)]])
    s = torch.stack([1 - 2 * (((a * i + b) % 13) % 2) for a, b in [(3, 2), (5, 4), (9, 1)]])
    return CountSketch.from_tables(h, s, columns=4)


def test_s2_hash_table_of_the_example():
    sk = _s2_example_sketch()
    i = torch.arange(12)
    assert sk.buckets(i).tolist() == [[1, 0, 3, 2, 0, 3, 2, 1, 0, 2, 1, 0],
                                      [2, 3, 0, 0, 1, 1, 2, 3, 3, 0, 0, 1],
                                      [3, 2, 0, 3, 1, 0, 2, 0, 3, 1, 0, 2]]
    sign = {"+": 1.0, "-": -1.0}
    rows = ["+-+--+-++-+-", "+--+--++-++-", "-+++---++++-"]
    assert sk.signs(i).tolist() == [[sign[c] for c in r] for r in rows]


def _close(t, expect):
    torch.testing.assert_close(t, torch.tensor(expect, dtype=t.dtype), rtol=0, atol=1e-15)


def _sv(d):
    return torch.tensor(sorted(d)), torch.tensor([d[i] for i in sorted(d)], dtype=torch.float64)


def test_s2_worker_a_every_cell_and_median():
    sk = _s2_example_sketch()
    table = sk.encode(*_sv(S2_A))
    assert table.tolist() == S2_SKETCH_A  # exact: every cell is a sum of dyadic values
    assert block_bitmap(torch.tensor([1, 3, 5]), 6).tolist() == [0, 1, 0, 1, 0, 1]
    idx = torch.tensor(sorted(S2_QUERY_A))
    est = sk.estimates(table, idx)
    for col, i in enumerate(idx.tolist()):
        assert est[:, col].tolist() == S2_QUERY_A[i][0], i
    assert median_rows(est).tolist() == [S2_QUERY_A[i][1] for i in idx.tolist()]


def test_s2_two_workers_through_the_reducer():
    """Two ranks, block size 2, r x c = 3 x 4 with the example's hashes injected: one SUM all-reduce of
    [sketch | bitmap], the union blocks queried. Rank A keeps its 3 non-zero blocks, rank B its 2 (the
    example's per-rank block budgets are injected like its hashes; the density is the same)."""

    class ExampleS2(S2Reducer):
        example_blocks = 0

        def sketch_for(self, expected_nnz, call=None, numel=None):
            return _s2_example_sketch()

        @property
        def kblocks(self):
            return self.example_blocks

    def fn(comm):
        g, blocks = (S2_A, 3) if comm.rank == 0 else (S2_B, 2)
        r = ExampleS2(comm, density=0.5, rows=3, columns=4, block_size=2)
        r.example_blocks = blocks
        grad = torch.zeros(12, dtype=torch.float64)
        idx, val = _sv(g)
        grad[idx] = val
        sk = _s2_example_sketch()
        own = sk.encode(idx, val)
        out = r.reduce(grad)
        return own, out, dict(r.stats)

    (own_a, out, stats), (own_b, out_b, _) = ss.run_local(fn, 2)
    assert torch.equal(out, out_b)
    assert own_a.tolist() == S2_SKETCH_A
    _close(own_b, S2_SKETCH_B)  # 0.3 - 1.5 etc. are not dyadic: exact up to one rounding
    _close(own_a + own_b, S2_SKETCH_SUM)
    assert stats["union_blocks"] == 4  # bitmap [0,1,0,2,1,1]: blocks 1, 3, 4, 5
    expect = torch.zeros(12, dtype=torch.float64)
    for i, m in S2_MEDIANS_SUM.items():
        expect[i] = m
    assert out.tolist() == pytest.approx(expect.tolist(), abs=1e-15)
    assert [i for i in range(12) if i not in S2_MEDIANS_SUM] == [0, 1, 4, 5]  # block 0 and 2: not queried


# ====================================================================== §8 MiCRO
MICRO_ACC = [[0.2, -1.5, 0.3, 0.9, 0.1, 1.2, -0.4, 0.0, 2.0, 0.5],
             [1.1, 0.2, -0.3, -1.8, 0.6, 0.1, 0.7, -1.0, 0.2, 0.1],
             [-0.6, 0.4, 1.3, 0.2, -0.2, 0.3, 1.6, 0.4, -0.9, 1.2],
             [0.3, -1.3, 0.2, 1.4, -1.1, 0.5, 0.1, -0.7, 0.4, -2.5]]


def test_micro_one_iteration_through_the_reducer():
    """§8.2 at t = 1, delta = 1.0: selections, union, summed values and every rank's new residual."""

    def fn(comm):
        r = ss.make_reducer("micro", comm, density=0.4, rule="micro", threshold=1.0, cap_factor=None)
        r.step = 1  # the example's iteration (partition rotation t = 1)
        out = r.reduce(torch.tensor(MICRO_ACC[comm.rank], dtype=torch.float64))
        return r.last_indices.tolist(), r.last_union.tolist(), out, r.residual.clone(), dict(r.stats)

    res = ss.run_local(fn, 4)
    assert [x[0] for x in res] == [[5], [7], [9], [1]]
    assert all(x[1] == [1, 5, 7, 9] for x in res)
    g_t = {1: -1.5 + 0.2 + 0.4 - 1.3, 5: 1.2 + 0.1 + 0.3 + 0.5, 7: 0.0 - 1.0 + 0.4 - 0.7, 9: 0.5 + 0.1 + 1.2 - 2.5}
    assert [g_t[i] for i in (1, 5, 7, 9)] == pytest.approx([-2.2, 2.1, -1.3, -0.7], abs=1e-12)
    for w, (_, _, out, res_w, stats) in enumerate(res):
        assert torch.equal(out, res[0][2])
        assert out.tolist() == pytest.approx([0, -2.2, 0, 0, 0, 2.1, 0, -1.3, 0, -0.7], abs=1e-12)
        assert (out[[1, 5, 7, 9]] / 4).tolist() == pytest.approx([-0.55, 0.525, -0.325, -0.175], abs=1e-12)
        keep = [0.0 if i in (1, 5, 7, 9) else v for i, v in enumerate(MICRO_ACC[w])]
        assert res_w.tolist() == keep  # exact: zeroed on idx_t, untouched elsewhere
        assert stats["selected"] == 4 and stats["threshold"] == 1.0
    assert res[0][3][8] == 2.0  # w0 keeps 2.0 at index 8 (w2 owned [8,10) and saw only -0.9)


def test_micro_threshold_trace_all_rows():
    """§8.3: the authors' rule, k = 1000, all 8 rows (delta printed to 6 decimals)."""
    rows = [(0.015811, 5000, 1.005, 0.015890), (0.015890, 3000, 1.005, 0.015970),
            (0.015970, 1500, 1.005, 0.016050), (0.016050, 1080, 1.00125, 0.016070),
            (0.016070, 1000, 1.00125, 0.016090), (0.016090, 950, 1.00125, 0.016110),
            (0.016110, 900, 0.995, 0.016029), (0.016029, 850, 0.995, 0.015949)]
    c = ThresholdController(1000, initial_threshold(1000), rule="micro")
    for delta, K, factor, nxt in rows:
        d = c.delta
        assert d == pytest.approx(delta, abs=5e-7)
        assert c.update(K) == d * factor  # the exact factor of the row
        assert c.delta == pytest.approx(nxt, abs=5e-7)


# ====================================================================== §5 MG-WFBP
def test_mgwfbp_example_where_algorithm1_is_optimal():
    """§5.1: a = 1, b = 0.01, layers 1..4 (backward order is 4, 3, 2, 1)."""
    t_b, p = [2.0, 1.0, 0.5, 0.5][::-1], [100, 50, 300, 20][::-1]
    a, b = 1.0, 0.01
    wfbp = evaluate(plan_wfbp(4), t_b, p, a, b)
    # ready times C_4..C_1 and the initial tau_c of layers 4..1
    assert [round(x, 12) for x in wfbp["group_start_s"]] == [0.5, 1.7, 5.7, 7.2]
    assert wfbp["iteration_s"] == pytest.approx(9.2, abs=1e-12)
    assert evaluate(plan_single(4), t_b, p, a, b)["iteration_s"] == pytest.approx(9.7, abs=1e-12)
    alg1 = plan_mgwfbp(t_b, p, a, b)
    assert alg1 == [(0, 2), (2, 4)]  # m = (n, m, n, m): messages {4,3} and {2,1}
    ev = evaluate(alg1, t_b, p, a, b)
    assert ev["group_start_s"] == pytest.approx([1.0, 5.2], abs=1e-12)
    assert ev["group_finish_s"] == pytest.approx([5.2, 7.7], abs=1e-12)
    assert plan_optimal(t_b, p, a, b) == alg1 and brute_force(t_b, p, a, b)[1] == pytest.approx(7.7, abs=1e-12)


def test_mgwfbp_counterexample_dp_table():
    """§5.2: every option of the DP table ``F[l]`` (l = 4..1), as (j, units, finish)."""
    t_b, p = [2.0, 1.5, 1.5, 2.0][::-1], [10, 100, 50, 100][::-1]
    a, b = 2.0, 0.05
    F, options = optimal_table(t_b, p, a, b)
    spec = {4: [(5, 100, 9.0)],
            3: [(5, 150, 13.0), (4, 50, 13.5)],
            2: [(5, 250, 19.5), (4, 150, 18.5), (3, 100, 20.0)],
            1: [(5, 260, 22.0), (4, 160, 19.0), (3, 110, 20.5), (2, 10, 21.0)]}
    best = {4: 9.0, 3: 13.0, 2: 18.5, 1: 19.0}
    for layer, opts in spec.items():
        jj = 4 - layer + 1  # the first jj tensors in backward order end at layer ``layer``
        got = [(5 - i, units, fin) for i, units, fin in options[jj]]  # group starts at layer j-1 = 4-i
        assert [(j, u) for j, u, _ in got] == [(j, u) for j, u, _ in opts]
        assert [f for _, _, f in got] == pytest.approx([f for _, _, f in opts], abs=1e-12)
        assert F[jj] == pytest.approx(best[layer], abs=1e-12)
    assert plan_mgwfbp(t_b, p, a, b) == [(0, 3), (3, 4)]
    assert evaluate(plan_mgwfbp(t_b, p, a, b), t_b, p, a, b)["iteration_s"] == pytest.approx(22.0, abs=1e-12)
    assert evaluate(plan_wfbp(4), t_b, p, a, b)["iteration_s"] == pytest.approx(23.0, abs=1e-12)


# ====================================================================== §6 SparCML streams
def _vec(d, n=16):
    return SparseVec(torch.tensor(sorted(d)), torch.tensor([float(d[i]) for i in sorted(d)]), n)


def test_sparcml_stream_merge_and_bytes():
    """36 / 68 bytes in the spec = a 4-byte count + payload; our header is 8 bytes (int64 count, keeps
    int64 indices / float64 values aligned: ``sparse.HEADER_BYTES``), so the buffers are 40 / 72 and
    the payloads (4 items x 8 bytes, 16 values x 4 bytes) are the spec's exactly."""
    A, B = _vec({2: 1.0, 9: 2.0}), _vec({2: 0.5, 5: -1.0, 12: 4.0})
    C = _vec({0: 1.0, 5: 1.5, 7: -2.0, 10: 3.0, 15: 0.25})
    ab = sp.add(A, B)
    assert isinstance(ab, SparseVec) and ab.indices.tolist() == [2, 5, 9, 12]
    assert ab.values.tolist() == [1.5, -1.0, 2.0, 4.0]
    assert sp.encode(ab).numel() == sp.HEADER_BYTES + 4 * 8 == 36 - 4 + sp.HEADER_BYTES
    abc = sp.add(ab, C)
    assert not isinstance(abc, SparseVec)
    assert abc.tolist() == [1, 0, 1.5, 0, 0, 0.5, 0, -2, 0, 2, 3, 0, 4, 0, 0, 0.25]
    assert sp.encode(abc).numel() == sp.HEADER_BYTES + 16 * 4 == 68 - 4 + sp.HEADER_BYTES
    d3 = sp.add(abc, _vec({3: 4.0}))
    assert d3[3] == 4.0 and torch.equal(sp.add(_vec({3: 4.0}), abc), d3)
    lo, hi = _vec({1: 1, 3: 1, 4: 1, 6: 1}), _vec({8: 1, 11: 1, 13: 1, 14: 1})
    assert not isinstance(sp.add(lo, hi), SparseVec)  # bound 8 = phi(16): the code rule (>=) densifies
    assert sp.sparse_is_smaller(7, 16) and not sp.sparse_is_smaller(8, 16)


def test_sparcml_expected_union():
    assert round(expected_union(32, 512, 8), 2) == 206.48
    assert expected_union(32, 512, 8) == 512 * (1 - (1 - 1 / 16) ** 8)
