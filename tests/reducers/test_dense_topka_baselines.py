"""Baselines of the foundation: allgather / torch_sparse collectives, dense / topka reducers."""

import pytest
import torch

import sparsync as ss
from sparsync.collectives import COSTS
from sparsync.sparse import index_dtype_for

BASELINES = ("allgather", "torch_sparse")


def _vec(rank, n, density, pattern, seed=0):
    k = max(1, int(density * n))
    g = torch.Generator().manual_seed(1000 * seed + (0 if pattern == "identical" else rank))
    idx = torch.randperm(n, generator=g)[:k].sort().values
    vals = torch.randn(k, generator=torch.Generator().manual_seed(rank + 7)) + 3.0
    return ss.SparseVec(idx, vals, n)


def _all_baselines(comm, n, cases):
    out = []
    for density, pattern in cases:
        sv = _vec(comm.rank, n, density, pattern)
        res = {}
        for algo in BASELINES:
            comm.ledger.reset()
            res[algo] = (ss.sparse_allreduce(sv, comm, algorithm=algo).to_dense(), comm.ledger.snapshot())
        out.append((sv.to_dense(), res))
    return out


CASES = [(0.001, "random"), (0.05, "random"), (0.05, "identical"), (0.3, "random"), (0.6, "random")]


def _check_exact_and_consistent(results):
    for c in range(len(CASES)):
        ref = sum(r[c][0] for r in results)
        for algo in BASELINES:
            outs = [r[c][1][algo][0] for r in results]
            assert torch.allclose(outs[0], ref, rtol=1e-5, atol=1e-5), (algo, CASES[c])
            assert all(torch.equal(o, outs[0]) for o in outs), f"{algo}: ranks disagree"


@pytest.mark.parametrize("P", range(1, 17))
def test_exact_and_consistent_threads(P):
    _check_exact_and_consistent(ss.run_local(_all_baselines, P, 2000, CASES))


@pytest.mark.gloo
@pytest.mark.parametrize("P", range(1, 7))
def test_exact_and_consistent_gloo(P):
    _check_exact_and_consistent(ss.run_local(_all_baselines, P, 2000, CASES, backend="gloo"))


@pytest.mark.parametrize("P", [2, 4, 5, 8])
@pytest.mark.parametrize("density", [0.01, 0.2, 0.7])
def test_allgather_ledger_equals_formula(P, density):
    n = 3000
    res = ss.run_local(_all_baselines, P, n, [(density, "random")])
    k = max(1, int(density * n))
    ib = torch.empty(0, dtype=index_dtype_for(n)).element_size()
    want = COSTS["allgather"](P, n, k, value_bytes=4, index_bytes=ib)
    for r in res:
        led = r[0][1]["allgather"][1]
        assert led["rounds"] == want["rounds"]
        assert led["bytes_received"] == want["bytes_received"] == led["bytes_sent"]


def _reducer_steps(comm, name, n, steps, density):
    r = ss.make_reducer(name, comm, density=density)
    g = torch.Generator().manual_seed(comm.rank)
    rows = []
    for _ in range(steps):
        grad = torch.randn(n, generator=g)
        before = torch.zeros(n) if r.residual is None else r.residual.clone()
        out = r.reduce(grad)
        after = torch.zeros(n) if r.residual is None else r.residual.clone()
        rows.append((grad, before, after, out, dict(r.stats)))
    return rows, r.conserving


@pytest.mark.parametrize("name", ["dense", "topka"])
@pytest.mark.parametrize("P", [1, 2, 3, 7])
def test_reducers_conserve_and_agree(name, P):
    n, steps = 500, 4
    res = ss.run_local(_reducer_steps, P, name, n, steps, 0.03)
    assert res[0][1] is True
    for t in range(steps):
        outs = [r[0][t][3] for r in res]
        assert all(torch.equal(o, outs[0]) for o in outs)
        lhs = sum(r[0][t][0] + r[0][t][1] for r in res)
        rhs = outs[0] + sum(r[0][t][2] for r in res)
        assert torch.allclose(lhs, rhs, atol=1e-5)
        st = res[0][0][t][4]
        if name == "topka":
            assert st["selected"] == 15 and st["density"] == pytest.approx(0.03)
            assert bool((res[0][0][t][2] != 0).sum() <= n - 15)
        assert st["comm_s"] >= 0 and "bytes_received" in st


def test_topka_state_dict_resumes_bitwise():
    def work(comm):
        g = torch.Generator().manual_seed(comm.rank)
        grads = [torch.randn(300, generator=g) for _ in range(6)]
        a = ss.make_reducer("topka", comm, density=0.05)
        straight = [a.reduce(x) for x in grads]
        b = ss.make_reducer("topka", comm, density=0.05)
        for x in grads[:3]:
            b.reduce(x)
        c = ss.make_reducer("topka", comm, density=0.05)
        c.load_state_dict(b.state_dict())
        resumed = [c.reduce(x) for x in grads[3:]]
        return all(torch.equal(p, q) for p, q in zip(straight[3:], resumed)) and torch.equal(a.residual, c.residual)

    assert all(ss.run_local(work, 3))


# ---------------------------------------------------------------------- bad input
def test_numel_mismatch_across_ranks_is_named():
    def work(comm):
        sv = ss.SparseVec(torch.tensor([0]), torch.tensor([1.0]), 10 + comm.rank)
        ss.sparse_allreduce(sv, comm, algorithm="allgather")

    with pytest.raises(ValueError, match="numel differs across ranks"):
        ss.run_local(work, 3)

    def work2(comm):
        r = ss.make_reducer("topka", comm)
        r.reduce(torch.zeros(10 + comm.rank))

    with pytest.raises(ValueError, match="gradient numel differs"):
        ss.run_local(work2, 2)


@pytest.mark.gloo
def test_numel_mismatch_gloo_fails_fast():
    def work(comm):
        ss.sparse_allreduce(ss.SparseVec.empty(10 + comm.rank), comm, algorithm="allgather")

    with pytest.raises(ValueError, match="numel differs"):
        ss.run_local(work, 2, backend="gloo", timeout=20)


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), "x"])
def test_density_out_of_range(density):
    with pytest.raises(ValueError, match="density"):
        ss.run_local(lambda c: ss.make_reducer("topka", c, density=density), 1)


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="valid: .*allgather"):
        ss.run_local(lambda c: ss.sparse_allreduce(ss.SparseVec.empty(3), c, algorithm="nope"), 1)
    with pytest.raises(ValueError, match="valid: .*dense"):
        ss.run_local(lambda c: ss.make_reducer("nope", c), 1)
    with pytest.raises(TypeError, match="unknown options: colour"):
        ss.run_local(lambda c: ss.make_reducer("dense", c, colour=1), 1)


def test_reducer_input_checks():
    def work(comm, grad):
        ss.make_reducer("topka", comm).reduce(grad)

    with pytest.raises(ValueError, match="1-D"):
        ss.run_local(work, 1, torch.zeros(3, 3))
    with pytest.raises(TypeError, match="floating"):
        ss.run_local(work, 1, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="SparseVec"):
        ss.run_local(lambda c: ss.sparse_allreduce(torch.zeros(3), c, algorithm="allgather"), 1)
