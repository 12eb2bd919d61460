"""Executed simulation on the thread cluster's virtual clock agrees with every registered alpha-beta
formula within the stated tolerance (sparsync.sim.collectives.REL_TOL + alpha per size header)."""

import pytest

from sparsync.sim import collectives as C

ALGOS = C.algorithms()


def test_some_algorithms_have_formulas():
    names = {a.name for a in ALGOS}
    assert "dense" in names and "allgather" in names


@pytest.mark.parametrize("algo", ALGOS, ids=[f"{a.kind}:{a.name}" for a in ALGOS])
def test_executed_matches_formula(algo):
    # latency-dominated (small n) and bandwidth-dominated (larger n) regimes
    for P, n, d in ((4, 4096, 0.02), (8, 4096, 0.02), (16, 4096, 0.02), (8, 1 << 16, 0.01)):
        row = C.check_agreement(algo, P, n=n, density=d)
        assert row["ok"], (f"{algo.name} P={P} n={n}: executed {row['exec_s']:.4g} s outside "
                           f"[{row['lower']:.4g}, {row['upper']:.4g}] (formula [{row['pred_lo_s']:.4g}, "
                           f"{row['pred_hi_s']:.4g}])")


def test_dense_is_exact_and_prediction_scales():
    # dense ring all-reduce: virtual clock == formula exactly (no headers, no bounds)
    a = next(x for x in ALGOS if x.name == "dense")
    row = C.check_agreement(a, 8, n=1 << 12, density=1.0)
    assert row["exec_s"] == pytest.approx(row["pred_hi_s"], rel=1e-9)
    lo, hi = C.predicted_time(C.predicted(a, 4096, 1 << 20, 1.0), C.ALPHA, C.BETA)
    assert lo == hi == pytest.approx(2 * 4095 * C.ALPHA + C.BETA * (2 * 4095 * (1 << 22) // 4096))


def test_sweep_and_plot(tmp_path):
    res = C.sweep(n=2048, density=0.02, pred_ps=[2, 64, 4096], exec_ps=[2], names={"dense", "allgather"},
                  progress=lambda *_: None)
    assert {r["P"] for r in res["predicted"]} == {2, 64, 4096}
    assert all(r["ok"] for r in res["executed"])
    C.plot(res, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0
