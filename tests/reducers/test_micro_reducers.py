"""micro / hard_threshold / cltk / topka on the thread backend: conservation, consistency,
disjoint selections, ledger == formula, state round trip, bad input."""

import pytest
import torch

import sparsync as ss
from sparsync.reducers.cltk import CLTKReducer
from sparsync.reducers.hard_threshold import HardThresholdReducer
from sparsync.reducers.micro import MicroReducer
from sparsync.select.threshold import partition_bounds

NAMES = ["micro", "hard_threshold", "cltk", "topka"]
# hard_threshold gets a threshold that selects a few percent of unit-scale data
OPTS = {"micro": {}, "hard_threshold": {"threshold": 2.0}, "cltk": {}, "topka": {}}


def grad(rank, step, n, scale=1.0):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, generator=g) * scale * (1 + step % 3)


def run_steps(comm, name, n, steps, density=0.05, **opts):
    r = ss.make_reducer(name, comm, density=density, **{**OPTS[name], **opts})
    recs = []
    for t in range(steps):
        g = grad(comm.rank, t, n)
        before = torch.zeros(n) if r.residual is None else r.residual.clone()
        out = r.reduce(g)
        recs.append({"g": g, "before": before, "out": out, "after": r.residual.clone() if r.residual is not None
                         else torch.zeros(n), "stats": dict(r.stats),
                         "local": getattr(r, "last_indices", None)})
    return recs


def check_conserving_and_consistent(per_rank, P, steps):
    for t in range(steps):
        outs = [per_rank[r][t]["out"] for r in range(P)]
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), f"step {t}: outputs differ across ranks"
        lhs = sum(per_rank[r][t]["g"].double() + per_rank[r][t]["before"].double() for r in range(P))
        rhs = outs[0].double() + sum(per_rank[r][t]["after"].double() for r in range(P))
        torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-4 * P)


@pytest.mark.parametrize("P", list(range(1, 17)))
def test_conserving_consistent_thread(P):
    n, steps = 997 + 13 * P, 4

    def fn(comm):
        return {name: run_steps(comm, name, n, steps) for name in NAMES}

    res = ss.run_local(fn, P)
    for name in NAMES:
        check_conserving_and_consistent([res[r][name] for r in range(P)], P, steps)
    # micro: selections of different ranks never overlap and the union is what was sent
    for t in range(steps):
        sets = [set(res[r]["micro"][t]["local"].tolist()) for r in range(P)]
        assert sum(len(s) for s in sets) == len(set().union(*sets)) == res[0]["micro"][t]["stats"]["selected"]
        for r in range(P):  # each rank's indices lie inside the partition it owns this step
            s, e = partition_bounds(n, P)[(t % P + r) % P]
            assert all(s <= i < e for i in sets[r])


def test_reducer_flags():
    for cls in (MicroReducer, HardThresholdReducer, CLTKReducer):
        assert cls.conserving is True
    assert ss.make_reducer("topka", _Dummy()).conserving


class _Dummy:
    rank, world_size = 0, 1
    device = torch.device("cpu")


@pytest.mark.parametrize("P", [1, 2, 3, 4, 7, 8])
def test_ledger_matches_formula(P):
    n = 5000

    def fn(comm):
        out = {}
        for name in ("micro", "hard_threshold", "cltk"):
            recs = run_steps(comm, name, n, 3, density=0.02)
            out[name] = [rc["stats"] for rc in recs]
        out["rule_micro"] = [rc["stats"] for rc in run_steps(comm, "micro", n, 3, density=0.02, rule="micro")]
        out["ring_values"] = [rc["stats"] for rc in run_steps(comm, "micro", n, 3, density=0.02, values="allreduce")]
        out["gather_values"] = [rc["stats"] for rc in run_steps(comm, "micro", n, 3, density=0.02, values="gather")]
        return out

    res = ss.run_local(fn, P)
    k = round(0.02 * n)
    for t in range(3):
        for key, rule in (("micro", "histogram"), ("rule_micro", "micro"), ("ring_values", "histogram"),
                          ("gather_values", "histogram")):
            st = [res[r][key][t] for r in range(P)]
            counts = [s["local_selected"] for s in st]
            values = {"ring_values": "allreduce", "gather_values": "gather"}.get(key, "auto")  # auto: gather at P <= 2
            first = t < 2  # start="data": the first two windows all-gather the threshold estimates
            for r, s in enumerate(st):  # the owner path receives by rank: exact per rank
                pred = MicroReducer.predicted_cost(P, n, k, counts=counts, rule=rule, values=values, rank=r,
                                                   data_window=first)
                assert s["rounds"] == pred["rounds"] and s["bytes_received"] == pred["bytes_received"]
            worst = MicroReducer.predicted_cost(P, n, k, counts=counts, rule=rule, values=values, data_window=first)
            assert worst["bytes_received"] == max(s["bytes_received"] for s in st)
        st = [res[r]["hard_threshold"][t] for r in range(P)]
        pred = HardThresholdReducer.predicted_cost(P, n, k, counts=[s["selected"] for s in st])
        for s in st:
            assert s["rounds"] == pred["rounds"] and s["bytes_received"] == pred["bytes_received"]
        pred = CLTKReducer.predicted_cost(P, n, k)
        for r in range(P):
            s = res[r]["cltk"][t]
            assert s["rounds"] == pred["rounds"]
            if P > 1:
                assert s["bytes_received"] == pred["bytes_received"][0 if r == t % P else 1]
            assert s["selected"] == k and s["density"] == pytest.approx(k / n)
    # bounds of the generic formula
    lo, hi = MicroReducer.predicted_cost(4, n, k)["bytes_received"]
    assert lo < hi
    assert MicroReducer.predicted_cost(1, n, k) == {"rounds": 0, "bytes_received": 0}


def test_stats_metrics():
    def fn(comm):
        out = {}
        for name in NAMES:
            r = ss.make_reducer(name, comm, density=0.05, **OPTS[name])
            r.reduce(grad(comm.rank, 0, 4000))
            out[name] = dict(r.stats)
        return out

    res = ss.run_local(fn, 3)
    for name in NAMES:
        s = res[0][name]
        for key in ("selected", "density", "target_density", "select_s", "comm_s", "bytes_sent", "bytes_received"):
            assert key in s, (name, key)
        assert s["target_density"] == 0.05
        assert s["density"] == pytest.approx(s["selected"] / 4000)
    assert res[0]["micro"]["threshold"] > 0 and "passed" in res[0]["micro"]


@pytest.mark.parametrize("cut", [1, 5])  # 1: micro's second data-centred window still to come
def test_state_dict_round_trip_continues_bitwise(cut):
    n, P = 3000, 3

    def fn(comm):
        out = {}
        for name in NAMES:
            a = ss.make_reducer(name, comm, density=0.03, **OPTS[name])
            for t in range(cut):
                a.reduce(grad(comm.rank, t, n))
            sd = a.state_dict()
            b = ss.make_reducer(name, comm, density=0.03, **OPTS[name])
            b.load_state_dict(sd)
            same = True
            for t in range(cut, cut + 4):
                g = grad(comm.rank, t, n)
                oa, ob = a.reduce(g), b.reduce(g)
                same &= torch.equal(oa, ob) and torch.equal(a.residual, b.residual)
            out[name] = same
        return out

    for r in ss.run_local(fn, P):
        assert all(r.values()), r


def test_reuse_buffers_accumulates_in_place_and_never_touches_the_grad():
    """``reuse_buffers=True``: the residual tensor is the accumulator (updated in place, as
    documented) when nothing is checked, and with the input check on (the default) and the C kernels
    two buffers take turns (the check rides on the pass that writes one from the other); the gradient is only read,
    and the results equal a fresh ``grad + residual``."""
    def fn(comm):
        ok = True
        for policy in ("ignore", "error"):
            r = ss.make_reducer("micro", comm, density=0.05, nonfinite=policy)
            r2 = ss.make_reducer("micro", comm, density=0.05, reuse_buffers=False, nonfinite=policy)
            g0 = grad(comm.rank, 0, 1000)
            r.reduce(g0)
            r2.reduce(g0)
            held = r.residual
            snap = held.clone()
            storages = []
            for step in (1, 2, 3):
                g = grad(comm.rank, step, 1000)
                gc = g.clone()
                r.reduce(g)
                r2.reduce(g)
                storages.append(r.residual.untyped_storage().data_ptr())
                ok &= torch.equal(g, gc) and torch.equal(r2.residual, r.residual)
            if policy == "ignore":  # no check: one buffer, accumulated in place
                ok &= r.residual is held and not torch.equal(held, snap)
            else:  # checked (C or torch kernels alike): two buffers in turn: step 1's, then held's, then step 1's
                held_ptr = held.untyped_storage().data_ptr()
                ok &= storages[0] != held_ptr and storages[1] == held_ptr
                ok &= storages[2] == storages[0]
        return ok

    assert all(ss.run_local(fn, 2))


def test_empty_selection_and_force_nonempty():
    def fn(comm):
        out = {}
        for force in (False, True):
            r = ss.make_reducer("micro", comm, density=0.01, threshold=1e6, rule="micro",
                                force_nonempty=force)
            o = r.reduce(grad(comm.rank, 0, 1000))
            out[force] = (r.stats["selected"], int(torch.count_nonzero(o)), r.stats["rounds"])
        r = ss.make_reducer("hard_threshold", comm, density=0.01, threshold=1e6)
        o = r.reduce(grad(comm.rank, 0, 1000))
        out["ht"] = (r.stats["selected"], int(torch.count_nonzero(o)))
        return out

    res = ss.run_local(fn, 4)
    assert res[0][False] == (0, 0, 0)  # nothing selected anywhere: no payload collective at all
    assert res[0][True][0] == 4 and res[0][True][1] == 4
    assert res[0]["ht"] == (0, 0)


def test_histogram_rule_hits_target_each_step():
    """Unit-normal gradients: after the window has moved to the right scale, K is within 10%."""
    n, P = 20_000, 4

    def fn(comm):
        r = ss.make_reducer("micro", comm, density=0.01, threshold=2.0)
        ks = []
        for t in range(25):
            r.reduce(grad(comm.rank, t, n))
            ks.append(r.stats["selected"])
        return ks

    ks = ss.run_local(fn, P)[0]
    assert all(abs(k / 200 - 1) <= 0.1 for k in ks[10:]), ks


def test_cap_bounds_message():
    def fn(comm):
        r = ss.make_reducer("micro", comm, density=0.01, threshold=1e-6, rule="micro", cap_factor=2.0)
        r.reduce(grad(comm.rank, 0, 4000))
        return r.stats

    for s in ss.run_local(fn, 4):
        assert s["local_selected"] == 20 and s["passed"] > 20 and s["saturated"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), "a"])
def test_bad_density(name, density):
    with pytest.raises(ValueError):
        ss.make_reducer(name, _Dummy(), density=density)


@pytest.mark.parametrize("name,opts", [
    ("micro", {"threshold": 0}), ("micro", {"threshold": -1}), ("micro", {"rule": "bogus"}),
    ("micro", {"cap_factor": 0.5}), ("micro", {"cap_factor": "x"}), ("micro", {"spread": 1.0}),
    ("micro", {"bins": 0}), ("micro", {"bins": 2.5}), ("micro", {"gamma": 0}),
    ("hard_threshold", {"threshold": float("nan")}), ("hard_threshold", {"threshold": 0.0}),
])
def test_bad_options(name, opts):
    with pytest.raises(ValueError):
        ss.make_reducer(name, _Dummy(), density=0.01, **opts)


@pytest.mark.parametrize("name", ["micro", "hard_threshold", "cltk"])
def test_unknown_option_and_bad_grad(name):
    with pytest.raises(TypeError):
        ss.make_reducer(name, _Dummy(), density=0.01, bogus=1)

    def fn(comm):
        r = ss.make_reducer(name, comm, density=0.01)
        errs = []
        for bad in (torch.ones(2, 2), torch.ones(4, dtype=torch.int64), [1.0]):
            try:
                r.reduce(bad)
            except (TypeError, ValueError) as e:
                errs.append(type(e).__name__)
        r.reduce(torch.ones(10))
        try:
            r.reduce(torch.ones(11))
        except ValueError:
            errs.append("numel")
        return errs

    assert len(ss.run_local(fn, 1)[0]) == 4


def test_state_of_other_reducer_rejected():
    def fn(comm):
        a = ss.make_reducer("micro", comm, density=0.01)
        a.reduce(torch.randn(100))
        b = ss.make_reducer("cltk", comm, density=0.01)
        with pytest.raises(ValueError):
            b.load_state_dict(a.state_dict())
        return True

    assert ss.run_local(fn, 1)[0]


def test_more_ranks_than_entries():
    n, P = 5, 8

    def fn(comm):
        return run_steps(comm, "micro", n, 3, density=0.5) + run_steps(comm, "cltk", n, 3, density=0.5)

    res = ss.run_local(fn, P)
    check_conserving_and_consistent(res, P, 6)


def test_dense_warmup_end_restarts_the_threshold_window():
    """Density 1 for 6 steps, then 0.2 (a dense warm-up ending, as ``dense_steps`` does): the first
    sparse steps send about k, not ``cap_factor`` x k while the window climbs from the dense phase's
    near-zero threshold (before the restart: 0.8 for 5 steps here, 25 in a gpt run)."""
    n, P = 40_000, 4

    def fn(comm):
        r = ss.make_reducer("micro", comm, density=1.0)
        fr = []
        for t in range(10):
            r.density = 1.0 if t < 6 else 0.2
            r.reduce(grad(comm.rank, t, n, scale=1 / (1 + t % 3)))  # unit scale every step
            fr.append(r.stats["selected"] / n)
        return fr

    fr = ss.run_local(fn, P)[0]
    assert min(fr[:6]) >= 0.99, fr
    assert all(abs(f / 0.2 - 1) <= 0.1 for f in fr[6:8]), fr  # the two data windows
    assert max(fr[6:]) <= 0.3, fr
