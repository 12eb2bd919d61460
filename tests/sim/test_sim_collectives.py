"""The executed simulation's ledger (thread cluster, virtual clock) equals every registered formula.

No tolerance except the formula's own ``(low, high)`` bounds, which appear only where a size depends on
the random index pattern (the union after summing random index sets, where selected indices fall
among the Ok-Topk regions): such a formula states the range, the test checks the ledger lies in it.
Single-valued formulas must be equal. Threshold reducers get the step's per-rank counts (their
number of selected entries is data-dependent; the communication given the counts is exact). Inputs
put ``k/P`` indices in each of the ``P`` parts (``sim.collectives._balanced_indices``), so densities
below give ``k`` divisible by ``P``."""

import pytest

from sparsync.sim import collectives as C

ALGOS = C.algorithms()


def test_some_algorithms_have_formulas():
    names = {a.name for a in ALGOS}
    assert "dense" in names and "allgather" in names


@pytest.mark.parametrize("algo", ALGOS, ids=[f"{a.kind}:{a.name}" for a in ALGOS])
def test_executed_matches_formula(algo):
    # latency-dominated (small n) and bandwidth-dominated (larger n) regimes
    for P, n, d in ((4, 4096, 128 / 4096), (8, 4096, 128 / 4096), (16, 4096, 128 / 4096),
                    (8, 1 << 16, 512 / 65536)):
        row = C.check_agreement(algo, P, n=n, density=d)
        assert row["ok"], (f"{algo.name} P={P} n={n}: ledger rounds {row['exec_rounds']}, bytes "
                           f"{row['exec_bytes_received']}; formula rounds {row['pred_rounds']}, bytes "
                           f"{row['pred_bytes']}")
        if row["exec_uniform"] and row["exec_header_messages"] == 0 and not isinstance(row["pred_bytes"], tuple):
            # the same ledger on every rank, no size headers: the virtual clock is the formula's time
            assert row["exec_s"] == pytest.approx(row["pred_hi_s"], rel=1e-9)


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
