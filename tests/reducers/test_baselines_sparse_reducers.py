"""Baselines topkdsa, gtopk, oktopk (and topka): consistency, conservation, Table I bounds, bad input."""

import math

import pytest
import torch

import sparsync as ss
from sparsync.reducers.gtopk import GTopkReducer
from sparsync.reducers.oktopk import OkTopkReducer
from sparsync.reducers.topka import TopkAReducer
from sparsync.reducers.topkdsa import TopkDSAReducer
from test_spardl_reducer import _run_configs


def _configs(P):
    cfg = [("topkdsa", {}), ("oktopk", {"recompute_every": 2, "balance_every": 3}), ("topka", {})]
    if P & (P - 1) == 0:
        cfg += [("gtopk", {}), ("gtopk", {"residuals": "global"})]
    return cfg


@pytest.mark.parametrize("P", list(range(1, 17)))
def test_baselines_consistency_thread(P):
    cfg = _configs(P)
    res = ss.run_local(_run_configs, P, cfg, 403, 4, density=0.03)
    for c, (name, opts) in enumerate(cfg):
        for s in range(4):
            assert all(torch.equal(res[w][c][0][s], res[0][c][0][s]) for w in range(P)), (name, opts, s)
        if res[0][c][4]:  # conserving reducers: identity every step
            assert max(res[0][c][1]) < 1e-12, (name, opts, res[0][c][1])


def test_gtopk_partial_residual_is_not_conserving():
    res = ss.run_local(_run_configs, 8, [("gtopk", {})], 2000, 3, density=0.02)
    assert res[0][0][4] is False and max(res[0][0][1]) > 1e-3


def _ledger(comm, name, n, density, phases=None, **opts):
    r = ss.make_reducer(name, comm, density=density, **opts)
    g = torch.Generator().manual_seed(comm.rank)
    comm.ledger.reset()
    r.reduce(torch.randn(n, generator=g))
    if phases:
        got = [comm.ledger.phases[p] for p in phases if p in comm.ledger.phases]
        return sum(c.rounds for c in got), sum(c.bytes_received for c in got), r.k
    return r.stats["rounds"], r.stats["bytes_received"], r.k


def _within(x, bound, slack=0):
    if isinstance(bound, tuple):
        return bound[0] - 1e-9 <= x <= bound[1] + slack
    return x <= bound + slack


@pytest.mark.parametrize("P", list(range(2, 17)))
def test_table1_bounds(P):
    n, density = 100_000, 0.01
    k = 1000
    # TopkDSA: direct-send reduce-scatter + growing Bruck all-gather (+ 8-byte stream counts)
    pred = TopkDSAReducer.predicted_cost(P, n, k)
    for rounds, nbytes, _ in ss.run_local(_ledger, P, "topkdsa", n, density):
        assert rounds == pred["rounds"] <= P + 2 * math.log2(P)
        assert _within(nbytes, pred["bytes_received"], slack=16 * (P - 1)), (nbytes, pred)
    # Ok-Topk: the two data phases of a step (threshold/balancing phases are periodic extras)
    pred = OkTopkReducer.predicted_cost(P, n, k, recompute_every=32)  # data phases only
    for rounds, nbytes, _ in ss.run_local(_ledger, P, "oktopk", n, density,
                                          phases=["oktopk:reduce-scatter", "oktopk:allgather"]):
        assert rounds == 2 * (P - 1) == pred["rounds"]
        assert _within(nbytes, pred["bytes_received"]), (nbytes, pred)
        lo, hi = OkTopkReducer.table_cost(P, k)["units"]  # Table I (paper), in bytes of 4-byte units
        assert 4 * lo - 1e-9 <= nbytes <= 4 * hi, (nbytes, lo, hi)
    # TopkA (foundation): 2(P-1)k units + one 8-byte stream count per gathered item
    pred = TopkAReducer.predicted_cost(P, n, k)  # the formula `sparsync plan` uses
    for rounds, nbytes, _ in ss.run_local(_ledger, P, "topka", n, density):
        assert nbytes == (P - 1) * (8 + 8 * k) and (nbytes - 8 * (P - 1)) / 4 == 2 * (P - 1) * k
        assert {"rounds": rounds, "bytes_received": nbytes} == {k: pred[k] for k in ("rounds", "bytes_received")}
    if P & (P - 1) == 0:
        pred = GTopkReducer.predicted_cost(P, n, k)
        res = ss.run_local(_ledger, P, "gtopk", n, density)
        for rounds, _nbytes, _ in res:
            assert rounds <= pred["rounds"] == 2 * math.log2(P)
        assert res[0][1] == pred["bytes_received"] == math.log2(P) * k * 8  # root: log2 P lists of k pairs
        assert GTopkReducer.table_cost(P, k)["units"] == 4 * math.log2(P) * k  # Table I, critical path


def _make(comm, name, **opts):
    ss.make_reducer(name, comm, density=0.01, **opts)


@pytest.mark.parametrize("P", [3, 5, 6, 12])
def test_gtopk_needs_power_of_two(P):
    with pytest.raises(ValueError, match="power-of-two"):
        ss.run_local(_make, P, "gtopk", timeout=30)


def test_bad_options_baselines():
    with pytest.raises(ValueError):
        ss.run_local(_make, 4, "gtopk", residuals="local")
    with pytest.raises(ValueError):
        ss.run_local(_make, 4, "oktopk", recompute_every=0)
    with pytest.raises(TypeError):
        ss.run_local(_make, 4, "topkdsa", teams=2)


def _tiny(comm, name):
    r = ss.make_reducer(name, comm, density=1e-6)
    g = torch.Generator().manual_seed(comm.rank)
    outs = [r.reduce(torch.randn(50, generator=g)) for _ in range(3)]
    return r.k, outs


@pytest.mark.parametrize("name", ["topkdsa", "oktopk", "gtopk", "spardl"])
def test_tiny_density_and_tiny_vectors(name):
    res = ss.run_local(_tiny, 8, name, timeout=30)  # n = 50 < ranges/blocks of 64 bins; k = 1
    assert all(k == 1 for k, _ in res)
    assert all(torch.equal(o, res[0][1][s]) for _, outs in res for s, o in enumerate(outs))


def _cancelling(comm, n=4000, steps=3):
    g = torch.Generator().manual_seed(11 + comm.rank)
    r = ss.make_reducer("oktopk", comm, density=0.02)
    errs, backs = [], []
    for _ in range(steps):
        base = torch.randn(n, generator=g, dtype=torch.float64)
        base[:20] = 100.0  # 20 of the 80 largest entries of every rank: they cancel exactly across the 2 ranks
        grad = base if comm.rank == 0 else torch.cat([-base[:20], base[20:]])
        before = grad + (r.residual if r.residual is not None else 0)
        out = r.reduce(grad)
        with comm.unrecorded():
            tot, rs = comm.allreduce(before), comm.allreduce(r.residual)
        errs.append(float((tot - out - rs).abs().max()))
        backs.append(bool((r.residual[:20] == before[:20]).all()) and bool((out[:20] == 0).all()))
    return errs, backs, r.th_global


def test_oktopk_cancelled_sums_stay_in_the_residuals():
    """Selected entries whose sum over ranks is exactly 0 fail the global threshold (> 0): not in the
    output, and every rank keeps its own value (what ``_in_global_set`` reads off the output)."""
    for errs, backs, th in ss.run_local(_cancelling, 2):
        assert th > 0 and max(errs) < 1e-12 and all(backs)


def _threshold_step(comm, n=100_000):
    g = torch.Generator().manual_seed(5 + comm.rank)
    r = ss.make_reducer("oktopk", comm, density=0.01)
    r.reduce(torch.randn(n, generator=g))  # the balancing step
    snap = comm.ledger.snapshot()
    r.reduce(torch.randn(n, generator=g))
    cost = comm.ledger.since(snap)
    return cost["rounds"], cost["bytes_received"], cost["header_messages"]


@pytest.mark.parametrize("P", [2, 4, 5])
def test_oktopk_threshold_step_ledger(P):
    """Default ``recompute_every=1``, a step after the first estimate: one histogram all-gather around
    the previous threshold gives the threshold and every region's kept count, so the final all-gather
    has no count round (the only headers are the ``alltoallv``'s)."""
    pred = OkTopkReducer.predicted_cost(P, 100_000, 1000)
    for rounds, nbytes, headers in ss.run_local(_threshold_step, P):
        assert rounds == pred["rounds"] == 3 * (P - 1) and _within(nbytes, pred["bytes_received"])
        assert headers == P - 1


def _both_selects(comm, k=300):
    g = torch.Generator().manual_seed(3 + comm.rank)
    keys = (torch.randn(2000, generator=g).abs() * torch.rand(2000, generator=g).exp()).view(torch.int32)
    r = ss.make_reducer("oktopk", comm, density=0.01)
    radix = r._global_threshold(keys, k)  # th_global is None: the two-level radix select
    r.th_global = radix[0] * 1.7  # a previous threshold within a binade: the window hits
    window = r._window_threshold(keys, k, int(torch.tensor([r.th_global]).view(torch.int32)[0]))
    own = int((keys >= int(torch.tensor([radix[0]]).view(torch.int32)[0])).sum())
    far = r._window_threshold(keys, k, int(torch.tensor([radix[0] * 8]).view(torch.int32)[0]))
    return radix, window, own, far


def test_oktopk_window_threshold_equals_the_radix_select():
    """The one-all-gather window select gives the radix select's threshold bit for bit (both are the
    lower edge of the 2^11-pattern cell holding the k-th magnitude) and every region's kept count;
    a window that misses the k-th magnitude says so (None) on every rank."""
    res = ss.run_local(_both_selects, 3)
    for rank, (radix, window, own, far) in enumerate(res):
        assert window == radix and radix[1][rank] == own and far is None
