"""MG-WFBP trace simulation: ordering of strategies under the model and the paper's qualitative
claims on a synthetic many-small-tensors profile."""

import math

import pytest

from sparsync.sim import schedule as S


def _profile():
    # ResNet-like: 150 tiny tensors (1 KB) + a few large ones, 1 ms backward each
    sizes = [1024] * 150 + [4 << 20] * 10
    t_b = [1e-3] * len(sizes)
    return {"t_b": t_b, "sizes": sizes, "t_f": 0.05}


def test_alpha_beta_inversion():
    a, b = S.alpha_beta_from_fit()
    ra, rb = S.allreduce_model(16, a, b)
    assert ra == pytest.approx(S.PAPER_FIT["a"]) and rb == pytest.approx(S.PAPER_FIT["b"])
    da, db = S.allreduce_model(1024, a, b, algorithm="dbtree")
    assert da == pytest.approx(2 * a * 10) and db == pytest.approx(b)


def test_optimal_never_worse_and_merging_wins_at_scale():
    rows = S.simulate(_profile(), workers=[4, 16, 64, 256, 1024])
    by = {(r["N"], r["strategy"]): r for r in rows}
    for N in (4, 16, 64, 256, 1024):
        best = by[(N, "optimal")]["iteration_s"]
        for s in ("wfbp", "single", "mgwfbp"):
            assert best <= by[(N, s)]["iteration_s"] * (1 + 1e-12)
        assert by[(N, "mgwfbp")]["iteration_s"] <= by[(N, "wfbp")]["iteration_s"] * (1 + 1e-12)
        assert all(r["speedup"] <= N * (1 + 1e-9) for r in rows if r["N"] == N)
    # many small tensors: WFBP pays one startup each; at 64 workers MG-WFBP clearly beats it
    assert by[(64, "mgwfbp")]["speedup"] > 1.2 * by[(64, "wfbp")]["speedup"]
    # at large N merging degenerates toward few messages (paper: single-message at >= 256 workers)
    assert by[(1024, "mgwfbp")]["groups"] <= 3


def test_profile_real_model_small():
    p = S.profile_model("digits-mlp", batch=8, steps=2, warmup=1)
    assert p["tensors"] == 6 and len(p["t_b"]) == 6 and math.isclose(sum(p["sizes"]), 4 * p["params"])
    assert all(t >= 0 for t in p["t_b"]) and p["t_f"] > 0
