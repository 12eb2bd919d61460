"""Parameter-server baseline: exact sum, bitwise identical on every rank, any number of servers and
remainder lengths, the ledger's push/pull bytes computed from the data, the reducer conserves, the
train-linear option follows the collectives' trajectory, gloo processes agree with threads."""

import pytest
import torch

import sparsync as ss
from sparsync.bench.patterns import make_sparse
from sparsync.ps import ps_allreduce, shard_bounds
from sparsync.sparse import sparse_is_smaller, wire_nbytes


def _sum(comm, n, dens, servers):
    sv = make_sparse("random", comm.rank, comm.world_size, n, dens, seed=n)
    comm.ledger.reset()
    out = ps_allreduce(sv, comm, servers=servers)
    out = out.to_dense() if hasattr(out, "to_dense") else out
    return out, comm.ledger.bytes_received, sv


def _part(sv, lo, hi):
    return {i for i in sv.indices.tolist() if lo <= i < hi}


def _shard_sum_bytes(svs, lo, hi):
    """Wire size of a server's rank-order sum: the stream turns dense once the bound
    nnz(acc) + nnz(part) reaches the switch point (``sparse.add``, case 1a), else the union."""
    w, union, dense = hi - lo, set(), False
    for sv in svs:
        part = _part(sv, lo, hi)
        if union and not sparse_is_smaller(len(union) + len(part), w):
            dense = True
        union |= part
    return wire_nbytes(w if dense else len(union), w)


def _expected_bytes(svs, b, servers, r):
    """Bytes rank r receives, from the inputs: pushes of its shard (if a server), then every other
    server's summed shard."""
    out = 0
    if r < servers:
        out += sum(wire_nbytes(len(_part(sv, b[r], b[r + 1])), b[r + 1] - b[r]) for q, sv in enumerate(svs) if q != r)
    return out + sum(_shard_sum_bytes(svs, b[s], b[s + 1]) for s in range(servers) if s != r)


@pytest.mark.parametrize("P,servers", [(1, 1), (2, 1), (3, 2), (4, 1), (4, 4), (5, 3)])
def test_exact_identical_and_bytes(P, servers):
    for n, dens in ((97, 0.1), (1001, 0.02), (1001, 0.6)):
        res = ss.run_local(_sum, P, n, dens, servers)
        ref = sum(r[2].to_dense() for r in res)
        for out, _, _ in res:
            assert torch.equal(out, res[0][0]) and torch.allclose(out, ref, atol=1e-6)
        if P == 1:
            continue
        svs = [r[2] for r in res]
        for r, (_, nbytes, _) in enumerate(res):
            assert nbytes == _expected_bytes(svs, shard_bounds(n, servers), servers, r), (P, servers, n, r)


def test_shard_bounds_and_bad_servers():
    assert shard_bounds(10, 3) == [0, 4, 7, 10] and shard_bounds(2, 4) == [0, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="servers"):
        ss.run_local(lambda c: ss.make_reducer("ps", c, servers=3), 2)


def _reduce_steps(comm, servers):
    r = ss.make_reducer("ps", comm, density=0.05, servers=servers)
    g = torch.Generator().manual_seed(comm.rank)
    rows = []
    for _ in range(3):
        grad = torch.randn(503, generator=g, dtype=torch.float64)
        before = grad + (r.residual if r.residual is not None else 0)
        out = r.reduce(grad)
        rows.append((before, out, r.residual.clone()))
    return rows


def test_reducer_conserves_and_agrees():
    res = ss.run_local(_reduce_steps, 4, 2)
    for s in range(3):
        lhs = sum(res[w][s][0] for w in range(4))
        rhs = res[0][s][1] + sum(res[w][s][2] for w in range(4))
        assert torch.allclose(lhs, rhs, atol=1e-12)
        assert all(torch.equal(res[w][s][1], res[0][s][1]) for w in range(4))


def test_train_linear_ps_matches_collective():
    from sparsync.linear import make_synthetic, train

    tr, te = make_synthetic(800, 5000, 10, seed=3).split(0.25, 0)

    def fn(comm, alg, **kw):
        return train(comm, tr.to(torch.float64), "logreg", epochs=2, global_batch=100, lr=5.0, algorithm=alg,
                     test_ds=te.to(torch.float64), dtype=torch.float64, **kw)["w"]

    ref = ss.run_local(fn, 3, "ssar_split_allgather")[0]
    for servers in (1, 3):
        ws = ss.run_local(fn, 3, "ps", servers=servers)
        assert all(torch.equal(w, ws[0]) for w in ws)
        assert torch.allclose(ws[0], ref, rtol=1e-9, atol=1e-12)


@pytest.mark.gloo
def test_gloo_matches_thread():
    t = ss.run_local(_sum, 3, 1001, 0.05, 2)
    g = ss.run_local(_sum, 3, 1001, 0.05, 2, backend="gloo", timeout=60)
    assert torch.equal(t[0][0], g[0][0]) and [x[1] for x in t] == [x[1] for x in g]
