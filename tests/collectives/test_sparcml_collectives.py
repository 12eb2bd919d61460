"""SparCML sparse all-reduce family: exactness vs the dense sum, bitwise identical results on every
rank, any world size (fold/unfold), all three index patterns, densities 0.01%..50% (dense switch)."""

import hashlib

import pytest
import torch

import sparsync as ss
from sparsync.bench.patterns import make_sparse
from sparsync.collectives.sparcml_common import Fold, concat, part_bounds, split_stream
from sparsync.sparse import SparseVec

ALGOS = ["ssar_rec_dbl", "ssar_split_allgather", "dsar_split_allgather", "dsar_early_switch", "auto",
         "dsar_split_allgather:recdbl", "dsar_early_switch:recdbl"]


def _call(a):
    """'name:recdbl' runs ``name`` with the recursive-doubling dense all-gather; early switch with G = 2."""
    name, _, ag = a.partition(":")
    opts = {"group_size": 2} if name == "dsar_early_switch" else {}
    if ag:
        opts["allgather"] = ag
    return name, opts
PATTERNS = ["random", "identical", "disjoint"]
DENSITIES = [1e-4, 1e-3, 1e-2, 0.1, 0.3, 0.5]


def _cases(P, N):
    for pat in PATTERNS:
        for d in DENSITIES:
            if pat == "disjoint" and P * max(1, round(d * N)) > N:
                continue
            yield pat, d


def _refs(P, N, seed=3):
    return {(pat, d): sum(make_sparse(pat, r, P, N, d, seed).to_dense() for r in range(P))
            for pat, d in _cases(P, N)}


def _digest(sv: SparseVec) -> str:
    h = hashlib.sha1(sv.indices.numpy().tobytes())
    h.update(sv.values.numpy().tobytes())
    return h.hexdigest()


def _sweep(comm, N, refs, algos, seed=3):
    out = []
    for (pat, d), ref in refs.items():
        sv = make_sparse(pat, comm.rank, comm.world_size, N, d, seed)
        for a in algos:
            name, opts = _call(a)
            if name == "dsar_early_switch" and len(algos) == 1:
                opts.pop("group_size")  # default G = 8
            r = ss.sparse_allreduce(sv, comm, name, **opts)
            ok = torch.allclose(r.to_dense(), ref, rtol=1e-5, atol=1e-5)
            out.append(((pat, d, a), ok, _digest(r)))
    return out


def _check(res):
    for rows in zip(*res):
        key = rows[0][0]
        assert all(r[1] for r in rows), f"{key}: result differs from the dense sum"
        assert len({r[2] for r in rows}) == 1, f"{key}: ranks disagree bitwise"


@pytest.mark.parametrize("P", range(1, 17))
def test_exact_and_identical_thread(P):
    N = 6000
    refs = _refs(P, N)
    _check(ss.run_local(_sweep, P, N, refs, ALGOS))


@pytest.mark.gloo
@pytest.mark.parametrize("P", range(1, 9))
def test_exact_and_identical_gloo(P):
    N = 3000
    refs = {k: v for k, v in _refs(P, N).items() if k[1] in (1e-3, 0.3, 0.5)}
    _check(ss.run_local(_sweep, P, N, refs, ALGOS, backend="gloo", timeout=60))


def test_default_group_size_exercises_all_phases():
    # P = 16 > G = 8: phase 2 (cross-group reduce-scatter) runs with the default group size
    N = 5000
    refs = _refs(16, N)
    refs = {k: v for k, v in refs.items() if k[1] in (1e-3, 0.1, 0.5)}
    _check(ss.run_local(_sweep, 16, N, refs, ["dsar_early_switch"]))
    refs = {k: v for k, v in _refs(12, N).items() if k[1] in (1e-3, 0.1, 0.5)}
    _check(ss.run_local(_sweep, 12, N, refs, ["dsar_early_switch"]))


def test_worked_example_rec_dbl():
    # hand-worked example §6, P = 4, N = 16
    data = [({1: 1, 5: 1}), ({5: 2, 9: 1}), ({2: 1, 12: 1}), ({9: 3, 14: 1})]

    def fn(comm):
        d = data[comm.rank]
        sv = SparseVec(torch.tensor(sorted(d)), torch.tensor([float(d[i]) for i in sorted(d)]), 16)
        snap = comm.ledger.snapshot()
        r = ss.sparse_allreduce(sv, comm, "ssar_rec_dbl", check=False)
        return r, comm.ledger.since(snap)

    res = ss.run_local(fn, 4)
    for r, cost in res:
        assert isinstance(r, SparseVec)
        assert r.indices.tolist() == [1, 2, 5, 9, 12, 14]
        assert r.values.tolist() == [1, 1, 3, 4, 1, 1]
        assert cost["rounds"] == 2
    # stage 0: 2 items each; stage 1: r0/r1 receive 4 items from r2/r3, r2/r3 receive 3 items
    assert [c["bytes_received"] for _, c in res] == [8 + 16 + 8 + 32, 8 + 16 + 8 + 32, 8 + 16 + 8 + 24,
                                                     8 + 16 + 8 + 24]


def test_fold_mapping_and_parts():
    for P in range(1, 40):
        folds = [Fold(r, P) for r in range(P)]
        active = [f for f in folds if f.active]
        assert len(active) == folds[0].Pp and (folds[0].Pp & (folds[0].Pp - 1)) == 0
        assert sorted(f.vrank for f in active) == list(range(folds[0].Pp))
        assert all(folds[0].real(f.vrank) == f.rank for f in active)
    assert part_bounds(10, 4) == [0, 2, 4, 6, 10]


def test_split_and_concat_roundtrip():
    x = torch.zeros(50)
    x[[0, 3, 17, 18, 33, 49]] = torch.arange(1.0, 7.0)
    sv = SparseVec.from_dense(x)
    b = part_bounds(50, 4)
    parts = split_stream(sv, b)
    assert [p.numel for p in parts] == [12, 12, 12, 14]
    whole = parts[0]
    for p in parts[1:]:
        whole = concat(whole, p)
    assert isinstance(whole, SparseVec) and torch.equal(whole.to_dense(), x)
    # a dense piece makes the concatenation dense (cases 2c/2d)
    mixed = concat(parts[0].to_dense(), parts[1])
    assert not isinstance(mixed, SparseVec) and torch.equal(mixed, x[:24])
    mixed = concat(parts[0], parts[1].to_dense())
    assert torch.equal(mixed, x[:24])


def test_bad_options():
    sv = SparseVec(torch.tensor([1]), torch.tensor([1.0]), 10)
    with pytest.raises(ValueError, match="group_size"):
        ss.run_local(lambda c: ss.sparse_allreduce(sv, c, "dsar_early_switch", group_size=3), 2)


def test_float64_and_empty_inputs():
    def fn(comm):
        N = 1000
        if comm.rank % 2:
            sv = SparseVec.empty(N, dtype=torch.float64)
        else:
            sv = SparseVec(torch.tensor([comm.rank, 500]), torch.tensor([1.5, 2.0], dtype=torch.float64), N)
        return [ss.sparse_allreduce(sv, comm, _call(a)[0], **_call(a)[1]).to_dense() for a in ALGOS]

    res = ss.run_local(fn, 5)
    ref = torch.zeros(1000, dtype=torch.float64)
    ref[[0, 2, 4]] = 1.5
    ref[500] = 6.0
    for outs in res:
        for o in outs:
            assert o.dtype == torch.float64 and torch.equal(o, ref)
