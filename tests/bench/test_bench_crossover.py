"""Sparse-vs-dense summation crossover benchmark: both sums agree, the crossover is found from the
measured ratios, the switch rule's density is the byte break-even (no timing is asserted)."""

import pytest
import torch

from sparsync.bench import crossover as X
from sparsync.bench.patterns import make_sparse
from sparsync.sparse import sparse_is_smaller


def test_sums_agree_and_rows_complete():
    svs = [make_sparse("random", r, 3, 5000, 0.05, 1) for r in range(3)]
    assert torch.allclose(X.sum_sparse(svs).to_dense(), X.sum_dense(svs))
    row = X.measure(3, 5000, 0.05, repeats=1)
    assert row["sparse_s"] > 0 and row["dense_s"] > 0 and 0.05 <= row["union_density"] <= 0.15


def test_crossover_interpolation():
    rows = [{"density": 0.001, "sparse_s": 1.0, "dense_s": 4.0}, {"density": 0.01, "sparse_s": 2.0, "dense_s": 2.0},
            {"density": 0.1, "sparse_s": 8.0, "dense_s": 2.0}]
    assert X.crossover(rows) == pytest.approx(0.01)
    rows[1]["sparse_s"] = 1.0  # ratio 0.5 at 1 %, 4 at 10 %: crossover 1/3 of the way in log space
    assert X.crossover(rows) == pytest.approx(10 ** (-2 + 1 / 3))
    assert X.crossover(rows[:1]) is None


def test_switch_density_is_the_byte_break_even():
    n = 10_000
    d = X.switch_density(n)
    assert d == 0.5
    assert sparse_is_smaller(int(d * n) - 1, n) and not sparse_is_smaller(int(d * n), n)
