"""Comm on both backends: point-to-point and collectives, ledger accounting, virtual clock, failures."""

import time

import pytest
import torch

import sparsync as ss
from sparsync.comm import CommError


def _exercise(comm):
    """Every Comm call once; returns what each rank saw plus its ledger."""
    r, P = comm.rank, comm.world_size
    out = {}
    x = torch.arange(3, dtype=torch.float32) + 10 * r
    out["allgather"] = comm.allgather(x)
    out["allgatherv"] = comm.allgatherv(torch.full((r + 1,), float(r)))
    # padded to 70000 (P - 1) floats: over TorchComm's direct-gather limit (the collective's route);
    # rank 0 sends nothing
    out["allgatherv_big"] = comm.allgatherv(torch.full((70000 * r,), float(r)))
    out["allgather_direct"] = comm.allgather_direct(x)
    out["allreduce"] = comm.allreduce(x)
    out["max"] = comm.allreduce(x, op="max")
    out["alltoallv"] = comm.alltoallv([torch.full((j + 1,), float(100 * r + j)) for j in range(P)])
    out["bcast"] = comm.broadcast(x, src=P - 1)
    if P > 1:
        right, left = (r + 1) % P, (r - 1) % P
        with comm.phase("ring"):
            out["sendrecv_var"] = comm.sendrecv(torch.full((r + 2,), float(r)), right, left)
            out["sendrecv_fixed"] = comm.sendrecv(torch.full((4,), float(r)), right, left, recv_numel=4)
            out["empty"] = comm.sendrecv(torch.empty(0), right, left)
        if r == 0:
            comm.send(torch.tensor([7.0, 8.0]), 1)
            comm.send(torch.tensor([9.0]), 1, fixed=True)
        elif r == 1:
            out["recv"] = comm.recv(0)
            out["recv_fixed"] = comm.recv(0, numel=1)
        hs = comm.post([(right, torch.full((5,), float(r)))], [(left, 5, torch.float32)])
        out["post"] = hs[0].wait()
    comm.barrier()
    return out, comm.ledger.snapshot(), dict(comm.ledger.phases)


def _check(results, P):
    for r, (out, _led, phases) in enumerate(results):
        assert [t.tolist() for t in out["allgather"]] == [[10.0 * q, 10.0 * q + 1, 10.0 * q + 2] for q in range(P)]
        assert [t.tolist() for t in out["allgatherv"]] == [[float(q)] * (q + 1) for q in range(P)]
        assert [t.tolist() for t in out["allgatherv_big"]] == [[float(q)] * (70000 * q) for q in range(P)]
        assert [t.tolist() for t in out["allgather_direct"]] == [t.tolist() for t in out["allgather"]]
        assert torch.equal(out["allreduce"], sum(torch.arange(3.0) + 10 * q for q in range(P)))
        assert torch.equal(out["max"], torch.arange(3.0) + 10 * (P - 1))
        assert [t.tolist() for t in out["alltoallv"]] == [[float(100 * q + r)] * (r + 1) for q in range(P)]
        assert torch.equal(out["bcast"], torch.arange(3.0) + 10 * (P - 1))
        if P > 1:
            left = (r - 1) % P
            assert out["sendrecv_var"].tolist() == [float(left)] * (left + 2)
            assert out["sendrecv_fixed"].tolist() == [float(left)] * 4
            assert out["empty"].numel() == 0
            assert out["post"].tolist() == [float(left)] * 5
            ring = phases["ring"]
            assert ring.rounds == 3 and ring.messages_sent == 2  # the empty message is not sent
            assert ring.bytes_sent == 4 * ((r + 2) + 4) and ring.bytes_received == 4 * ((left + 2) + 4)
            assert ring.header_messages == 2  # the two variable-size sendrecvs
        if r == 1 and P > 1:
            assert out["recv"].tolist() == [7.0, 8.0] and out["recv_fixed"].tolist() == [9.0]


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_thread_comm_calls(P):
    _check(ss.run_local(_exercise, P, backend="thread"), P)


@pytest.mark.gloo
@pytest.mark.parametrize("P", [1, 3, 4])
def test_gloo_comm_calls_and_same_ledger_as_threads(P):
    gl = ss.run_local(_exercise, P, backend="gloo")
    _check(gl, P)
    th = ss.run_local(_exercise, P, backend="thread")
    assert [g[1] for g in gl] == [t[1] for t in th]  # identical accounting on both backends


def _subgroup_exercise(comm):
    """Every Comm call on a TorchComm over ranks 1..3 of 4 (messages address group ranks), plus a
    complex tensor by point-to-point messages; rank 0 only takes part in creating the group."""
    import torch.distributed as dist

    from sparsync.torchcomm import TorchComm

    group = dist.new_group([1, 2, 3])
    if comm.rank == 0:
        comm.barrier()
        return None
    sub = TorchComm(group)
    assert sub._direct_pg is group  # gloo does not coalesce: messages go by the group's send / recv
    out = _exercise(sub)
    r, P = sub.rank, sub.world_size
    z = torch.tensor([complex(r, -r), complex(2 * r, 1)], dtype=torch.complex64)
    got = sub.post([((r + 1) % P, z)], [((r - 1) % P, 2, torch.complex64)])[0].wait()
    comm.barrier()
    return out, got.tolist()


@pytest.mark.gloo
def test_gloo_comm_on_a_subgroup_addresses_group_ranks():
    res = ss.run_local(_subgroup_exercise, 4, backend="gloo")
    assert res[0] is None
    _check([r[0] for r in res[1:]], 3)
    for r in range(3):
        left = (r - 1) % 3
        assert res[r + 1][1] == [complex(left, -left), complex(2 * left, 1)]


def _equal_gather_routes(comm):
    """Which route TorchComm takes for equal-size gathers: the ring collective is disabled, so a
    gather that still succeeds went direct. Returns (small, at the limit, over the limit) routes, and
    the small gather's result."""
    from sparsync.torchcomm import DIRECT_GATHER_MAX

    def no_ring(t):
        raise AssertionError("ring all-gather used")

    ring = comm._allgather
    comm._allgather = no_ring
    r, P = comm.rank, comm.world_size
    limit = DIRECT_GATHER_MAX // 4
    routes, small = [], None
    # counts and padded lists: r + 3 int32, exactly DIRECT_GATHER_MAX bytes at the largest, one more int32
    for t in (torch.arange(r + 3, dtype=torch.int32), torch.full((limit - P + 1 + r,), r, dtype=torch.int32),
              torch.zeros(limit + 1, dtype=torch.int32)):
        try:
            got = comm.allgatherv(t)
            routes.append("direct")
        except AssertionError:  # every rank fails at the same call
            routes.append("ring")
            comm._allgather = ring  # the counts: the rest of the test needs a working group
            comm.allgatherv(t)
            comm._allgather = no_ring
            got = None
        if small is None and got is not None:
            small = [x.tolist() for x in got]
    comm.barrier()
    return routes, small


@pytest.mark.gloo
@pytest.mark.parametrize("P", [2, 3])
def test_gloo_small_equal_gathers_go_direct_from_three_ranks(P):
    for routes, small in ss.run_local(_equal_gather_routes, P, backend="gloo"):
        if P == 2:  # the ring is one exchange too: the collective stays
            assert routes == ["ring", "ring", "ring"]
        else:
            assert routes == ["direct", "direct", "ring"]
            assert small == [list(range(q + 3)) for q in range(P)]


def test_ledger_formulas_for_collectives():
    P, n = 4, 1000

    def work(comm):
        comm.allreduce(torch.zeros(n))
        a = comm.ledger.snapshot()
        comm.ledger.reset()
        comm.allgather(torch.zeros(n))
        return a, comm.ledger.snapshot()

    for ar, ag in ss.run_local(work, P):
        assert ar["rounds"] == 2 * (P - 1) and ar["bytes_received"] == 2 * (P - 1) * n * 4 // P
        assert ag["rounds"] == P - 1 and ag["bytes_received"] == (P - 1) * n * 4


def test_virtual_clock_alpha_beta():
    alpha, beta = 1e-3, 1e-6

    def work(comm):
        comm.sendrecv(torch.zeros(250), (comm.rank + 1) % 2, (comm.rank + 1) % 2, recv_numel=250)
        t1 = comm.clock
        comm.allgather(torch.zeros(250))
        return t1, comm.clock

    for t1, t2 in ss.run_local(work, 2, alpha=alpha, beta=beta):
        assert t1 == pytest.approx(alpha + beta * 1000)
        assert t2 == pytest.approx(t1 + alpha + beta * 1000)


def test_virtual_clock_receive_waits_for_arrival():
    def work(comm):
        if comm.rank == 0:
            comm.advance(5.0)
            comm.send(torch.zeros(1), 1, fixed=True)
        else:
            comm.recv(0, numel=1)
        return comm.clock

    t0, t1 = ss.run_local(work, 2, alpha=0.5)
    assert t0 == pytest.approx(5.5) and t1 == pytest.approx(5.5)


def test_mismatched_collectives_are_named():
    def work(comm):
        if comm.rank == 0:
            comm.allgather(torch.zeros(1))
        else:
            comm.allreduce(torch.zeros(1))

    with pytest.raises(CommError, match="collective mismatch"):
        ss.run_local(work, 2, timeout=10)


def test_bad_peer_and_sizes():
    def self_send(comm):
        comm.send(torch.zeros(1), comm.rank)

    with pytest.raises(CommError, match="cannot message itself"):
        ss.run_local(self_send, 2)

    def unequal(comm):
        comm.allgather(torch.zeros(comm.rank + 1))

    with pytest.raises(CommError, match="allgatherv"):
        ss.run_local(unequal, 2)

    def two_d(comm):
        comm.allreduce(torch.zeros(2, 2))

    with pytest.raises(ValueError, match="1-D"):
        ss.run_local(two_d, 2)


def test_thread_timeout_instead_of_hang():
    def work(comm):
        if comm.rank == 1:
            comm.recv(0, numel=1)  # rank 0 never sends

    t = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out"):
        ss.run_local(work, 2, timeout=1.0)
    assert time.monotonic() - t < 10


def _pipelined_allreduce(comm, n):
    """A copy-then-all-reduce long enough to be cut into pieces (TorchComm._allreduce_into)."""
    g = torch.Generator().manual_seed(100 + comm.rank)
    x = torch.randn(n, generator=g)
    keep = x.clone()
    out = torch.full((n,), float("nan"))
    comm.ledger.reset()
    got = comm.allreduce(x, out=out)
    got = got.clone()  # at once: a piece still in flight would show here
    fresh = comm.allreduce(x)  # out=None: a new tensor, the same path
    mx = comm.allreduce(x, op="max", out=torch.empty(n))
    led = comm.ledger.snapshot()
    inplace = x.clone()
    comm.allreduce(inplace, out=inplace, pieces=True)  # the same pieces, in place
    checked = ss.make_reducer("dense", comm).reduce(x).clone()  # checked copy, then those pieces
    unchecked = ss.make_reducer("dense", comm, nonfinite="ignore").reduce(x).clone()  # piecewise copy
    assert torch.equal(x, keep)
    return x, keep, got, out, fresh, mx, led, (inplace, checked, unchecked)


@pytest.mark.gloo
def test_gloo_pipelined_copy_allreduce_is_exact_and_identical():
    """Above COPY_PIPELINE_MIN elements the copy into ``out`` and the all-reduce run in pieces: the
    input stays untouched, ``out`` is filled everywhere (it started as NaN), the sum matches the
    float64 sum and every rank holds the same bits; ``max`` too; the ledger is one all-reduce."""
    from sparsync.torchcomm import COPY_PIPELINE, COPY_PIPELINE_MIN

    assert COPY_PIPELINE >= 2
    P, n = 3, COPY_PIPELINE_MIN + 12345  # pieces of unequal length
    res = ss.run_local(_pipelined_allreduce, P, n, backend="gloo")
    ref = sum(res[r][1].double() for r in range(P))
    ref_max = torch.stack([res[r][1] for r in range(P)]).amax(0)
    for r, (x, keep, got, out, fresh, mx, led, same_pieces) in enumerate(res):
        for y in same_pieces:  # in place in pieces, and the dense reducer both ways: the same bits
            assert torch.equal(y, got), f"rank {r}: a pieced all-reduce differs"
        assert torch.equal(x, keep), "the input was modified"
        assert torch.equal(got, out) and not torch.isnan(got).any()
        assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(got, res[0][2]) and torch.equal(fresh, got), f"rank {r} differs"
        assert torch.equal(mx, ref_max)
        assert led["bytes_received"] == 3 * (2 * (P - 1) * n * 4 // P) and led["rounds"] == 3 * 2 * (P - 1)
