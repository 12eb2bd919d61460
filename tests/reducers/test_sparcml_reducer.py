"""The ``sparcml`` reducer: conservation, bitwise identical output, every selection and algorithm,
state round trip, bad options."""

import pytest
import torch

import sparsync as ss

SELECTIONS = ["topk", "bucketed", "bucketed_topk", "approx", "approx_at_most"]
ALGOS = ["auto", "ssar_rec_dbl", "ssar_split_allgather", "dsar_split_allgather", "dsar_early_switch"]


def _run(comm, combos, steps=3, n=4000):
    out = []
    for sel, alg in combos:
        r = ss.make_reducer("sparcml", comm, density=0.02, selection=sel, algorithm=alg, seed=3, group_size=2)
        g = torch.Generator().manual_seed(100 + comm.rank)
        for s in range(steps):
            grad = torch.randn(n, generator=g)
            before = torch.zeros(n) if r.residual is None else r.residual.clone()
            o = r.reduce(grad)
            out.append(((sel, alg, s), grad + before, o, r.residual.clone(), r.stats["selected"]))
    return out


@pytest.mark.parametrize("P", [1, 3, 4])
def test_conserving_and_identical(P):
    combos = [(s, "auto") for s in SELECTIONS] + [("topk", a) for a in ALGOS[1:]]
    res = ss.run_local(_run, P, combos)
    for rows in zip(*res):
        key = rows[0][0]
        lhs = sum(r[1] for r in rows)
        rhs = rows[0][2] + sum(r[3] for r in rows)
        assert torch.allclose(lhs, rhs, atol=1e-5), key
        assert all(torch.equal(r[2], rows[0][2]) for r in rows), key
        if key[0] == "topk":
            assert all(r[4] == 80 for r in rows)
        if key[0].startswith("bucketed"):  # fixed slots: 4000 = 7 buckets of 512 + 416, kb = round(0.02*512) = 10
            assert all(r[4] == 80 for r in rows)


def test_state_roundtrip_bitwise():
    def fn(comm):
        r = ss.make_reducer("sparcml", comm, density=0.05, selection="approx", seed=1)
        g = torch.Generator().manual_seed(comm.rank)
        grads = [torch.randn(2000, generator=g) for _ in range(4)]
        r.reduce(grads[0])
        r.reduce(grads[1])
        st = r.state_dict()
        a = [r.reduce(grads[2]), r.reduce(grads[3])]
        r2 = ss.make_reducer("sparcml", comm, density=0.05, selection="approx", seed=1)
        r2.load_state_dict(st)
        b = [r2.reduce(grads[2]), r2.reduce(grads[3])]
        return all(torch.equal(x, y) for x, y in zip(a, b))

    assert all(ss.run_local(fn, 2))


def test_dense_below_and_bad_options():
    def fn(comm):
        r = ss.make_reducer("sparcml", comm, density=0.01, dense_below=10000)
        return r.reduce(torch.ones(100) * (comm.rank + 1))

    assert all(torch.equal(o, torch.full((100,), 3.0)) for o in ss.run_local(fn, 2))
    comm = ss.run_local(lambda c: c, 1)[0]
    with pytest.raises(ValueError, match="selection"):
        ss.make_reducer("sparcml", comm, selection="nope")
    with pytest.raises(ValueError, match="algorithm"):
        ss.make_reducer("sparcml", comm, algorithm="nope")
    with pytest.raises(TypeError, match="unknown options"):
        ss.make_reducer("sparcml", comm, bogus=1)


def test_auto_state_is_the_reducers_own():
    """``algorithm="auto"``: the calibration lives in the reducer's AutoState, none on the comm."""
    from sparsync.collectives.auto import AutoState

    def fn(comm):
        before = set(vars(comm))
        r = ss.make_reducer("sparcml", comm, density=0.02)
        r.reduce(torch.randn(4000, generator=torch.Generator().manual_seed(comm.rank)))
        stashed = [k for k in set(vars(comm)) - before if isinstance(vars(comm)[k], AutoState)]
        fixed = ss.make_reducer("sparcml", comm, density=0.02, algorithm="ssar_rec_dbl")
        return isinstance(r.auto_state, AutoState) and r.auto_state.calibration is not None, stashed, \
            fixed.auto_state

    assert ss.run_local(fn, 3) == [(True, [], None)] * 3
