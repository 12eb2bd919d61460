"""Wire-level pieces of the lossless collectives: the one-pass multi-operand sum, flat all-gather,
all-reduce into a given buffer, and the backend sparse all-reduce capability."""

import pytest
import torch

from sparsync.reducers.micro import MicroReducer

import sparsync as ss
from sparsync.bench.patterns import make_sparse
from sparsync.sparse import SparseVec, add, sparse_is_smaller, sum_streams


def _chain(parts):
    acc = parts[0]
    for p in parts[1:]:
        acc = add(acc, p)
    return acc


@pytest.mark.parametrize("pattern,density", [("random", 0.01), ("identical", 0.2), ("random", 0.2),
                                             ("disjoint", 0.05), ("random", 0.4)])
def test_sum_streams_bitwise_equals_pairwise_adds_and_follows_the_switch_rule(pattern, density):
    P, n = 5, 6001
    parts = [make_sparse(pattern, r, P, n, density, seed=2) for r in range(P)]
    parts = [SparseVec(p.indices, p.values * 1.7 ** r, n) for r, p in enumerate(parts)]  # rounding matters
    got = sum_streams(parts, n)
    dense_ref = torch.zeros(n)
    for p in parts:
        dense_ref.index_add_(0, p.indices, p.values)
    assert torch.equal(ss.sparse.as_dense(got), dense_ref)  # same bits as a rank-order scatter-add
    assert torch.equal(ss.sparse.as_dense(got), ss.sparse.as_dense(_chain(parts)))
    union = torch.unique(torch.cat([p.indices for p in parts])).numel()
    total = sum(p.nnz for p in parts)
    expect_sparse = total < n and sparse_is_smaller(union, n)
    assert isinstance(got, SparseVec) == expect_sparse
    if expect_sparse:
        assert got.nnz == union
    # any dense operand makes the result dense
    mixed = sum_streams([parts[0], parts[1].to_dense()], n)
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, parts[0].to_dense() + parts[1].to_dense())


def _comm_caps(comm):
    P, r = comm.world_size, comm.rank
    t = torch.arange(5, dtype=torch.float32) + 10 * r
    flat = comm.allgather_into(t, torch.empty(5 * P))
    own = torch.full((7,), float(r + 1))
    inplace = comm.allreduce(own, out=own)
    src = torch.full((4,), 2.0 * r)
    buf = torch.empty(4)
    into = comm.allreduce(src, out=buf)
    snap = comm.ledger.snapshot()
    sv = make_sparse("random", r, P, 500, 0.05 * (1 + r))  # different counts per rank
    idx, vals = comm.sparse_allreduce_coo(sv.indices, sv.values, 500)
    cost = comm.ledger.since(snap)
    with pytest.raises(ss.comm.CommError, match="allgather_into"):
        comm.allgather_into(t, torch.empty(3))
    return flat, inplace is own, own, into is buf, buf, src, idx, vals, cost


@pytest.mark.parametrize("backend", ["thread", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_comm_capabilities_same_on_both_backends(backend):
    P, n = 3, 500
    res = ss.run_local(_comm_caps, P, backend=backend)
    ref = sum(make_sparse("random", r, P, n, 0.05 * (1 + r)).to_dense() for r in range(P))
    m = max(make_sparse("random", r, P, n, 0.05 * (1 + r)).nnz for r in range(P))
    for r, (flat, same, own, same2, buf, src, idx, vals, cost) in enumerate(res):
        assert torch.equal(flat, torch.cat([torch.arange(5.0) + 10 * q for q in range(P)]))
        assert same and torch.equal(own, torch.full((7,), float(sum(range(1, P + 1)))))
        assert same2 and torch.equal(buf, torch.full((4,), 2.0 * sum(range(P))))
        assert torch.equal(src, torch.full((4,), 2.0 * r))
        dense = torch.zeros(n)
        dense[idx] = vals
        assert torch.allclose(dense, ref) and bool((idx[1:] > idx[:-1]).all())
        assert cost["rounds"] == 2 * (P - 1) and cost["bytes_received"] == (P - 1) * m * 12
    assert all(torch.equal(r[7], res[0][7]) for r in res)


# ---------------------------------------------------------------------- half-precision values on the wire
def _half_steps(comm, name, value_dtype, n, steps, **opts):
    if name == "hard_threshold":
        opts["threshold"] = 800.0  # ~1% of N(0, 300)
    r = ss.make_reducer(name, comm, density=0.01, value_dtype=value_dtype, **opts)
    g = torch.Generator().manual_seed(comm.rank)
    rows = []
    for _ in range(steps):
        grad = torch.randn(n, generator=g) * 3e2  # some values above fp16's max after accumulation
        grad[comm.rank] = 1e6
        before = torch.zeros(n) if r.residual is None else r.residual.clone()
        out = r.reduce(grad)
        own, union = getattr(r, "last_indices", None), getattr(r, "last_union", None)  # micro's selection
        rows.append((grad + before, r.residual.clone(), out, dict(r.stats),
                     None if own is None else own.clone(), None if union is None else union.clone()))
    return rows


@pytest.mark.parametrize("name", ["topka", "hard_threshold"])
@pytest.mark.parametrize("value_dtype,wdt", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_values_conserve_exactly_and_halve_the_value_bytes(name, value_dtype, wdt):
    P, n, steps = 3, 4000, 3
    res = ss.run_local(_half_steps, P, name, value_dtype, n, steps)
    fp32 = ss.run_local(_half_steps, P, name, "fp32", n, 1)
    for s in range(steps):
        sent = []
        for r in range(P):
            acc, resid, out, stats = res[r][s][:4]
            d = acc - resid  # what rank r sent, exactly (residual = acc - float(rounded))
            nz = d != 0
            assert torch.equal(d[nz].to(wdt).float(), d[nz])  # every sent value is a half-precision number
            assert float(d.abs().max()) <= (65504.0 if wdt == torch.float16 else float("inf"))
            sent.append(d)
        # conservation with the rounded values: acc_r == residual_r + sent_r bitwise (checked above by
        # construction), and out == the fp32 rank-order sum of the sent values, bitwise on every rank
        ref = torch.zeros(n)
        for d in sent:
            ref += d
        for r in range(P):
            assert torch.equal(res[r][s][2], ref), (r, s)
        k_sent = [int((d != 0).sum()) for d in sent]
        m = max(res[r][s][3]["selected"] for r in range(P))
        assert all(ks <= res[r][s][3]["selected"] for r, ks in enumerate(k_sent))
        assert res[0][s][3]["bytes_received"] == (P - 1) * (8 + m * (4 + 2))  # int32 index + 2-byte value
    assert fp32[0][0][3]["bytes_received"] == (P - 1) * (8 + max(f[0][3]["selected"] for f in fp32) * 8)


def test_value_dtype_errors():
    comm = ss.threadcomm.ThreadWorld(1).comms()[0]
    with pytest.raises(ValueError, match="value_dtype must be one of"):
        ss.make_reducer("topka", comm, value_dtype="fp8")
    with pytest.raises(ValueError, match="does not support value_dtype"):
        ss.make_reducer("gtopk", comm, value_dtype="fp16")


def _value_allreduce_steps(comm, name, value_dtype):
    opts = {"values": "allreduce"} if name == "micro" else {}  # micro's ring all-reduce of the values
    r = ss.make_reducer(name, comm, density=0.01, value_dtype=value_dtype, **opts)
    g = torch.Generator().manual_seed(comm.rank)
    rows = []
    for _ in range(3):
        grad = torch.randn(5000, generator=g)
        before = torch.zeros(5000) if r.residual is None else r.residual.clone()
        snap = comm.ledger.snapshot()
        out = r.reduce(grad)
        vals_bytes = comm.ledger.phases[f"{name}.values"].bytes_received
        rows.append((grad + before, r.residual.clone(), out, vals_bytes, comm.ledger.since(snap)))
    return rows, r.conserving


@pytest.mark.parametrize("name", ["micro", "cltk"])
def test_value_allreduce_reducers_in_half_precision(name):
    P = 4
    res = ss.run_local(_value_allreduce_steps, P, name, "bf16")
    assert all(c is False for _, c in res)  # the half-precision sum is outside any residual: said so
    for s in range(3):
        sent = [res[r][0][s][0] - res[r][0][s][1] for r in range(P)]
        for d in sent:  # each rank's own rounding stays in its residual, exactly
            assert torch.equal(d.to(torch.bfloat16).float(), d)
        outs = [res[r][0][s][2] for r in range(P)]
        assert all(torch.equal(o, outs[0]) for o in outs)
        ref, mag = sum(sent), sum(d.abs() for d in sent)
        assert bool(((outs[0] - ref).abs() <= 2 ** -6 * mag).all())  # P-1 bf16 roundings of partial sums
    # value bytes: 2 per value in the ring all-reduce (cumulative over the 3 steps)
    full = ss.run_local(_value_allreduce_steps, P, name, "fp32")
    assert all(c is True for _, c in full)
    for r in range(P):
        assert res[r][0][-1][3] * 2 == full[r][0][-1][3] or name == "micro"  # micro's union can differ


def _sparcml_half(comm, algorithm, value_dtype):
    r = ss.make_reducer("sparcml", comm, density=0.02, algorithm=algorithm, value_dtype=value_dtype)
    g = torch.Generator().manual_seed(comm.rank)
    rows = []
    for _ in range(2):
        grad = torch.randn(3001, generator=g)
        before = torch.zeros(3001) if r.residual is None else r.residual.clone()
        out = r.reduce(grad)
        rows.append((grad + before, r.residual.clone(), out, r.stats["bytes_received"]))
    return rows


@pytest.mark.parametrize("P", [4, 3, 6])
@pytest.mark.parametrize("algorithm", ["ssar_rec_dbl", "ssar_split_allgather", "dsar_split_allgather",
                                       "dsar_early_switch", "auto"])
def test_sparcml_half_values_conserve(P, algorithm):
    res = ss.run_local(_sparcml_half, P, algorithm, "fp16")
    full = ss.run_local(_sparcml_half, P, algorithm, "fp32")
    for s in range(2):
        sent = [res[r][s][0] - res[r][s][1] for r in range(P)]
        for d in sent:  # acc == residual + sent exactly, sent values are fp16 numbers
            assert torch.equal(d.to(torch.float16).float(), d)
        outs = [res[r][s][2] for r in range(P)]
        assert all(torch.equal(o, outs[0]) for o in outs)  # bitwise identical on every rank
        ref = torch.stack(sent).double().sum(0)
        assert torch.allclose(outs[0].double(), ref, rtol=1e-6, atol=1e-6)  # summed in fp32
    assert sum(r[0][3] for r in res) < sum(r[0][3] for r in full)  # fewer bytes than fp32 values


def test_dense_reducer_leaves_input_or_reduces_in_place():
    def fn(comm):
        g = torch.full((6,), float(comm.rank + 1))
        keep = ss.make_reducer("dense", comm)
        out1 = keep.reduce(g)
        out2 = keep.reduce(g)
        donate = ss.make_reducer("dense", comm, inplace=True)
        out3 = donate.reduce(g)
        return g, out1, out2, out3 is g

    for g, out1, out2, same in ss.run_local(fn, 3):
        assert torch.equal(out1, torch.full((6,), 6.0)) and torch.equal(out2, out1)  # input untouched twice
        assert same and torch.equal(g, torch.full((6,), 6.0))  # donated buffer holds the sum


def _to_wire(x, wdt):
    return (x.clamp(-65504.0, 65504.0) if wdt == torch.float16 else x).to(wdt).float()


@pytest.mark.parametrize("value_dtype,wdt", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_micro_owner_sum_keeps_half_values_conserving(value_dtype, wdt, P):
    """micro's owner value path (the default for P > 2) with fp16/bf16 on the wire: each rank's
    contribution travels rounded, the owner adds the P contributions in fp32 in rank order and sends
    the sum back rounded too. Each rounding error stays in a residual - the contributions' in the
    sender's, the sums' in the owner's (at its own indices) - so the exchange is conserving, and every
    rank holds the same bits."""
    n, steps = 4001, 3
    res = ss.run_local(_half_steps, P, "micro", value_dtype, n, steps, values="owner")  # default for P > 2
    comm = ss.threadcomm.ThreadWorld(1).comms()[0]
    assert ss.make_reducer("micro", comm, value_dtype=value_dtype).conserving
    assert not ss.make_reducer("micro", comm, value_dtype=value_dtype, values="allreduce").conserving
    for s in range(steps):
        union = res[0][s][5]
        assert union.numel() > 0 and all(torch.equal(res[r][s][5], union) for r in range(P))
        sent = [_to_wire(res[r][s][0][union], wdt) for r in range(P)]  # what each rank put on the wire
        total = torch.zeros(union.numel())  # the owners' fp32 rank-order sums
        for x in sent:
            total += x
        wire = _to_wire(total, wdt)
        err = torch.zeros(n)
        err[union] = total - wire  # the sums' rounding error, kept by each index's owner
        assert bool((err != 0).any())  # the test must see a sum that half precision cannot hold
        for r in range(P):
            acc, resid, out, stats, mine, _ = res[r][s]
            assert torch.equal(out[union], wire), (r, s)  # the rounded sums, bitwise on every rank
            assert int(torch.count_nonzero(out)) <= union.numel() and not bool(out.index_fill(0, union, 0).any())
            expect = acc.clone()
            expect[union] = acc[union] - sent[r]
            expect[mine] += err[mine]
            assert torch.equal(resid, expect), (r, s)
        # conservation (float64): sum_r acc_r == out + sum_r residual_r up to the fp32 rounding of the
        # owners' residual entries (without the kept sum error it would be off by ~2^-11 of a sum)
        acc64 = sum(res[r][s][0].double() for r in range(P))
        resid64 = sum(res[r][s][1].double() for r in range(P))
        gap = (acc64 - resid64 - res[0][s][2].double()).abs()
        scale = sum(res[r][s][1].double().abs() for r in range(P)) + acc64.abs()
        assert bool((gap <= scale * 2.0 ** -22).all())
        assert not bool(((gap - err.double()).abs() <= scale * 2.0 ** -22).all())  # without the kept error
        counts = [res[q][s][3]["local_selected"] for q in range(P)]
        for r in range(P):
            pred = MicroReducer.predicted_cost(P, n, round(0.01 * n), counts=counts, value_bytes=2, rank=r,
                                               values="owner", data_window=s < 2)
            assert res[r][s][3]["bytes_received"] == pred["bytes_received"]


@pytest.mark.parametrize("value_dtype,wdt", [("fp16", torch.float16), ("fp32", torch.float32)])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_micro_gathered_values_sum_the_same_bits_everywhere_and_conserve(value_dtype, wdt, P):
    """micro's ``values="gather"``: every rank all-gathers the P contributions at the union (rounded to
    the wire dtype, each rank keeping its own rounding error) and adds them in rank order in fp32: the
    output at the union is that sum, bitwise, on every rank; nothing else is rounded (no sum goes back
    over the wire), and the ledger is ``(P - 1) K value_bytes`` for the values."""
    n, steps = 4001, 3
    res = ss.run_local(_half_steps, P, "micro", value_dtype, n, steps, values="gather")
    comm = ss.threadcomm.ThreadWorld(1).comms()[0]
    assert ss.make_reducer("micro", comm, value_dtype=value_dtype, values="gather").conserving
    for s in range(steps):
        union = res[0][s][5]
        assert union.numel() > 0 and all(torch.equal(res[r][s][5], union) for r in range(P))
        sent = [_to_wire(res[r][s][0][union], wdt) for r in range(P)]
        total = torch.zeros(union.numel())
        for x in sent:
            total += x
        for r in range(P):
            acc, resid, out, stats, mine, _ = res[r][s]
            assert torch.equal(out[union], total), (r, s)
            assert not bool(out.index_fill(0, union, 0).any())
            expect = acc.clone()
            expect[union] = acc[union] - sent[r]
            assert torch.equal(resid, expect), (r, s)  # exactly the unsent part, rounding error included
        counts = [res[q][s][3]["local_selected"] for q in range(P)]
        vb = 2 if wdt == torch.float16 else 4
        for r in range(P):
            pred = MicroReducer.predicted_cost(P, n, round(0.01 * n), counts=counts, value_bytes=vb, rank=r,
                                               values="gather", data_window=s < 2)
            assert res[r][s][3]["bytes_received"] == pred["bytes_received"]
            assert res[r][s][3]["rounds"] == pred["rounds"]
