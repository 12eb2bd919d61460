"""``ss.sparse_allreduce_dense``: the dense sum without the SparseVec round trip, and the plain
all-gather references of ``sparsync bench``.

Properties that could fail: for every registered algorithm, world size (powers of two and not),
value dtype and index pattern, the dense result is bitwise ``sparse_allreduce(...).to_dense()``,
the same bits on every rank, also when written into a caller's ``out`` full of garbage; the ledger
of the dense call equals the sparse call's (the formulas are unchanged); a result the caller still
holds is never overwritten by the next call; bad ``out`` is refused with one line. The plain
all-gather references (even and uneven counts) equal the float64 sum.
"""

import pytest
import torch

import sparsync as ss
from sparsync.bench.patterns import make_sparse
from sparsync.bench.reducers import PLAIN, collective_fn
from sparsync.collectives import load_all

N = 3000


def _dense_vs_sparse(comm, dt):
    out = {}
    for pat in ("random", "heavy_tail", "identical"):
        sv = make_sparse(pat, comm.rank, comm.world_size, N, 0.05, 0, dtype=dt)
        for a in sorted(load_all()):
            if a == "torch_sparse" and dt != torch.float32:
                continue  # gloo's sparse all-reduce has no half kernels
            # auto with tune=False: the model's pick, the same for a dense and a sparse result (measuring,
            # it keeps one choice per shape, and a dense and a sparse result are two shapes)
            opts = {"tune": False} if a == "auto" else {}
            s0 = comm.ledger.snapshot()
            ref = ss.sparse_allreduce(sv, comm, a, check=False, **opts)
            s1 = comm.ledger.snapshot()
            d = ss.sparse_allreduce_dense(sv, comm, a, check=False, **opts)
            s2 = comm.ledger.snapshot()
            garbage = torch.full((N,), float("nan"), dtype=d.dtype)
            d2 = ss.sparse_allreduce_dense(sv, comm, a, out=garbage, **opts)
            want = ref.to_dense().to(d.dtype)
            assert d2 is garbage
            assert torch.equal(want, d) and torch.equal(want, d2), (a, pat)
            assert _diff(s0, s1) == _diff(s1, s2), a  # the same ledger: the formulas hold for both
            out[pat, a] = d.clone()
    return out


def _diff(a, b):
    return {k: b[k] - a.get(k, 0) for k in b}


@pytest.mark.parametrize("P", [1, 3, 4])
@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
def test_dense_equals_sparse_to_dense_thread(P, dt):
    res = ss.run_local(_dense_vs_sparse, P, dt)
    assert all(torch.equal(r[key], res[0][key]) for r in res for key in r)


@pytest.mark.gloo
@pytest.mark.parametrize("P", [2, 4])
def test_dense_equals_sparse_to_dense_gloo(P):
    res = ss.run_local(_dense_vs_sparse, P, torch.float32, backend="gloo")
    assert all(torch.equal(r[key], res[0][key]) for r in res for key in r)


def _held(comm):
    sv = make_sparse("random", comm.rank, comm.world_size, N, 0.05, 0)
    a = ss.sparse_allreduce_dense(sv, comm, "allgather")
    keep = a.clone()
    sv2 = make_sparse("random", comm.rank, comm.world_size, N, 0.05, 1)
    b = ss.sparse_allreduce_dense(sv2, comm, "ssar_split_allgather")
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, keep)
    del a
    c = ss.sparse_allreduce_dense(sv, comm, "allgather")  # may reuse the dropped buffer: still exact
    return torch.equal(c, keep)


def test_held_result_not_overwritten():
    assert all(ss.run_local(_held, 2))


def test_bad_out_refused():
    def fn(comm):
        sv = make_sparse("random", comm.rank, 2, N, 0.05, 0)
        for bad in (torch.zeros(N + 1), torch.zeros(N, dtype=torch.float64), torch.zeros(2, N)[:, 0]):
            with pytest.raises(ValueError, match="out must be"):
                ss.sparse_allreduce_dense(sv, comm, "allgather", out=bad)
        with pytest.raises(TypeError, match="needs a SparseVec"):
            ss.sparse_allreduce_dense(torch.zeros(N), comm)
        return True

    assert all(ss.run_local(fn, 2))


def _plain(comm, uneven):
    dens = 0.02 * (1 + comm.rank) if uneven else 0.02
    sv = make_sparse("heavy_tail", comm.rank, comm.world_size, N, dens, 0)
    return {name: collective_fn(comm, name, sv)() for name in PLAIN
            if not (uneven and name == "plain_allgather_int64")}  # it needs equal counts


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("backend", ["thread", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_plain_allgather_references_exact(uneven, backend):
    P = 3
    res = ss.run_local(_plain, P, uneven, backend=backend)
    ref = torch.zeros(N, dtype=torch.float64)
    for r in range(P):
        sv = make_sparse("heavy_tail", r, P, N, 0.02 * (1 + r) if uneven else 0.02, 0)
        ref.index_add_(0, sv.indices, sv.values.double())
    for out in res:
        for name in out:
            assert torch.allclose(out[name].double(), ref, rtol=1e-6, atol=1e-9), name
            assert torch.equal(out[name], res[0][name]), name
    if uneven:
        with pytest.raises(Exception, match="same nnz"):
            ss.run_local(lambda c: collective_fn(c, "plain_allgather_int64", make_sparse(
                "random", c.rank, 2, N, 0.01 * (1 + c.rank), 0)), 2)
