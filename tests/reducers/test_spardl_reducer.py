"""SparDL reducer: bitwise consistency, conservation (GRES), ledger == formula, teams, bad input."""

import math

import pytest
import torch

import sparsync as ss
from sparsync.reducers.spardl import SparDLReducer, auto_candidates, check_teams


def _run_configs(comm, configs, n, steps, density=0.05, dtype=torch.float64):
    """Run each (name, options) for ``steps`` steps; return outputs, conservation errors, stats, ledgers."""
    res = []
    for name, opts in configs:
        g = torch.Generator().manual_seed(1000 * comm.rank + 7)
        r = ss.make_reducer(name, comm, density=density, **opts)
        outs, errs, ledgers = [], [], []
        for _ in range(steps):
            grad = torch.randn(n, generator=g, dtype=dtype)
            grad[:: 7] *= 10  # some structure: heavy entries
            before = grad + (r.residual if r.residual is not None else 0)
            snap = comm.ledger.snapshot()
            out = r.reduce(grad)
            ledgers.append(comm.ledger.since(snap))
            with comm.unrecorded():
                tot = comm.allreduce(before)
                rs = comm.allreduce(r.residual)
            errs.append(float((tot - out - rs).abs().max() / tot.abs().max()))
            outs.append(out)
        res.append((outs, errs, dict(r.stats), ledgers, r.conserving))
    return res


def _configs(P):
    cfg = [("spardl", {})]
    for d in range(2, P + 1):
        if P % d == 0:
            if d & (d - 1) == 0:
                cfg.append(("spardl", {"teams": d}))  # R-SAG
            cfg.append(("spardl", {"teams": d, "team_allgather": "b"}))
    return cfg


@pytest.mark.parametrize("P", list(range(1, 17)))
def test_consistency_and_conservation_thread(P):
    cfg = _configs(P)
    res = ss.run_local(_run_configs, P, cfg, 403, 3)
    for c, (name_opts) in enumerate(cfg):
        for s in range(3):
            ref = res[0][c][0][s]
            assert all(torch.equal(res[w][c][0][s], ref) for w in range(P)), (name_opts, s)
            assert all(res[w][c][1][s] < 1e-12 for w in range(P)), (name_opts, s, res[0][c][1])


@pytest.mark.parametrize("P,d,kind", [(8, 2, "r"), (8, 4, "r"), (16, 8, "r"), (8, 8, "r"),
                                      (6, 3, "b"), (10, 5, "b"), (14, 7, "b"), (12, 6, "b"), (14, 2, "b")])
def test_conservation_many_steps_teams(P, d, kind):
    res = ss.run_local(_run_configs, P, [("spardl", {"teams": d, "team_allgather": kind})], 1000, 8,
                       density=0.02)
    for w in range(P):
        assert max(res[w][0][1]) < 1e-12
        assert all(torch.equal(res[w][0][0][s], res[0][0][0][s]) for s in range(8))
    if kind == "b":
        assert "h" in res[0][0][2] and "N_t" in res[0][0][2]


@pytest.mark.parametrize("mode", ["partial", "local"])
def test_partial_and_local_residuals_lose_mass(mode):
    res = ss.run_local(_run_configs, 6, [("spardl", {"residuals": mode}), ("spardl", {})], 600, 4)
    lossy, gres = res[0]
    assert lossy[4] is False and gres[4] is True
    assert max(lossy[1]) > 1e-3  # mass lost every step (in-procedure residuals dropped)
    assert max(gres[1]) < 1e-12


def test_float32_consistency():
    res = ss.run_local(_run_configs, 6, [("spardl", {}), ("spardl", {"teams": 3})], 5000, 3,
                       dtype=torch.float32)
    for c in range(2):
        assert all(torch.equal(res[w][c][0][s], res[0][c][0][s]) for w in range(6) for s in range(3))


# ---------------------------------------------------------------- ledger == formula
def _ledger(comm, n, density, opts):
    r = ss.make_reducer("spardl", comm, density=density, **opts)
    g = torch.Generator().manual_seed(comm.rank)
    r.reduce(torch.randn(n, generator=g))
    return r.stats["rounds"], r.stats["bytes_received"], r.k, comm.ledger.header_bytes


@pytest.mark.parametrize("P", list(range(2, 17)))
def test_ledger_d1_exact(P):
    n, k = 50_400, 5040  # 5040 is divisible by every P in 2..16 except 11 and 13 (integer form there)
    density = k / n
    res = ss.run_local(_ledger, P, n, density, {})
    for rounds, nbytes, kk, hdr in res:
        assert kk == k
        assert rounds == 2 * math.ceil(math.log2(P))
        assert hdr == 0  # fixed capacity: no size header
        kb = k // P
        assert nbytes == 2 * (P - 1) * kb * 8  # exact integer form
        if k % P == 0:
            assert nbytes / 4 == 4 * k * (P - 1) / P  # Table I, in 4-byte index+value units
        assert {"rounds": rounds, "bytes_received": nbytes} == SparDLReducer.predicted_cost(P, n, k)


@pytest.mark.parametrize("P,d,kind", [(4, 2, "r"), (8, 2, "r"), (8, 4, "r"), (16, 4, "r"), (16, 8, "r"),
                                      (6, 3, "b"), (12, 3, "b"), (12, 6, "b"), (14, 7, "b"), (15, 5, "b"),
                                      (8, 4, "b")])
def test_ledger_teams_within_bounds(P, d, kind):
    n, k = 50_400, 5040 * 2
    res = ss.run_local(_ledger, P, n, k / n, {"teams": d, "team_allgather": kind})
    pred = SparDLReducer.predicted_cost(P, n, k, teams=d, team_allgather=kind)
    table = SparDLReducer.table_cost(P, k, d, kind)
    q = P // d
    for rounds, nbytes, _, hdr in res:
        assert hdr == 0
        assert rounds == pred["rounds"] == 2 * math.ceil(math.log2(q)) + math.ceil(math.log2(d))
        units = nbytes / 4
        if kind == "r":
            assert nbytes == pred["bytes_received"]
            assert units == pytest.approx(table)
        else:
            lo, hi = pred["bytes_received"]
            assert lo <= nbytes <= hi
            assert table[0] - 1e-9 <= units <= table[1] + 1e-9


# ---------------------------------------------------------------- teams="auto"
def _auto(comm, n):
    r = ss.make_reducer("spardl", comm, density=0.05, teams="auto", auto_steps=2)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(2 * len(r.candidates) + 2):
        r.reduce(torch.randn(n, generator=g, dtype=torch.float64))
    return r.auto_times, r.label(r.d, r.kind), r.stats.get("teams"), r.state_dict()["extra"]["d"]


def test_auto_picks_one_d_everywhere():
    res = ss.run_local(_auto, 6, 3000)
    times, choice, used, _d = res[0]
    assert set(times) == {"d=1", "R-SAG d=2", "B-SAG d=3"}
    assert choice == min(times, key=times.get) == used
    assert all(r[:3] == res[0][:3] for r in res)
    assert auto_candidates(12) == [(1, "none"), (2, "r"), (3, "b"), (4, "r"), (6, "b")]


# ---------------------------------------------------------------- bad input
def _make(comm, name, **opts):
    ss.make_reducer(name, comm, density=0.01, **opts)


@pytest.mark.parametrize("opts,msg", [
    ({"teams": 4}, "must divide"), ({"teams": 3, "team_allgather": "r"}, "power of two"),
    ({"teams": 0}, "must divide"), ({"teams": "two"}, "integer"),
    ({"residuals": "none"}, "residuals"), ({"team_allgather": "x", "teams": 2}, "'r'")])
def test_bad_options(opts, msg):
    with pytest.raises(ValueError, match=msg):
        ss.run_local(_make, 6, "spardl", **opts)
    with pytest.raises(ValueError):
        check_teams(6, 4)


def _tiny(comm):
    r = ss.make_reducer("spardl", comm, density=1e-5, teams=2 if comm.world_size % 2 == 0 else 1)
    g = torch.Generator().manual_seed(comm.rank)
    grad = torch.randn(1000, generator=g, dtype=torch.float64)
    out = r.reduce(grad)
    with comm.unrecorded():
        err = float((comm.allreduce(grad) - out - comm.allreduce(r.residual)).abs().max())
    return r.k, r.stats["selected"], err, out


def test_density_too_small_falls_back_to_one_per_block():
    res = ss.run_local(_tiny, 8, timeout=30)
    for k, sel, err, out in res:
        assert k == 1 and sel == 4  # kb = max(1, floor(k d / P)) = 1 per block, q = 4 blocks
        assert err < 1e-12
        assert torch.equal(out, res[0][3])


def _resume(comm):
    g = torch.Generator().manual_seed(comm.rank)
    grads = [torch.randn(900, generator=g, dtype=torch.float64) for _ in range(5)]
    a = ss.make_reducer("spardl", comm, density=0.05, teams=3)
    for x in grads[:3]:
        a.reduce(x)
    b = ss.make_reducer("spardl", comm, density=0.05, teams=3)
    b.load_state_dict(a.state_dict())
    return [torch.equal(a.reduce(x), b.reduce(x)) and a.stats["h"] == b.stats["h"] for x in grads[3:]]


def test_state_dict_resumes_bsag_bitwise():
    assert all(all(r) for r in ss.run_local(_resume, 6))
