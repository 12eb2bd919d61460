"""DiLoCo with ``overlap=tau``: the exchange of a period's pseudo-gradient runs in the background during
the next tau inner steps, then the outer step is applied and each rank's progress since is kept.
On gloo ranks: the parameters follow a by-hand reference of that rule bit for bit (dyadic values), the
ranks' mean is what plain averaging leaves it, the shared parameters agree bitwise across ranks for
sparse reducers, a checkpoint taken while an exchange is in flight resumes bitwise, and bad options
are one-line errors."""

import io

import pytest
import torch

import sparsync as ss
from diloco_helpers import classify_step
from sparsync.localsteps.overlap import check_overlap

LR, H, STEPS = 0.25, 3, 14


class _Linear(torch.nn.Module):
    """Parameters whose gradient is a given constant: loss = sum(w * c)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 16)
        self.b = torch.nn.Parameter(torch.full((5,), 0.5))


def _coeff(step, rank):
    """Dyadic gradients (multiples of 1/8 in [-1, 1]): every sum below is exact in fp32."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(-8, 9, (17,), generator=g).float() / 8


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _reference(P, tau):
    """The overlapped rule by hand for every rank: per step, each rank's parameters."""
    shared = _flat(_Linear())
    local = [shared.clone() for _ in range(P)]
    anchor, pending, since, inner, out = None, False, 0, 0, []
    for step in range(STEPS):
        local = [x - LR * _coeff(step, r) for r, x in enumerate(local)]
        inner += 1
        if pending:
            since += 1
            if since == tau:
                new = shared - sum(shared - a for a in anchor) / P  # outer SGD lr 1: the mean pseudo-gradient
                local = [new + (x - a) for x, a in zip(local, anchor)]
                shared, pending = new, False
        if inner == H:
            anchor, pending, since, inner = [x.clone() for x in local], True, 0, 0
        out.append([x.clone() for x in local])
    return out


def _run(comm, tau):
    torch.set_num_threads(1)
    model = _Linear()
    dl = ss.DiLoCo(model, comm, torch.optim.SGD(model.parameters(), lr=LR), sync_every=H, outer_lr=1.0,
                   outer_momentum=0.0, overlap=tau)
    params, flags = [], []
    for step in range(STEPS):
        c = _coeff(step, comm.rank)
        dl.zero_grad()
        (model.w * c[:12].view(3, 4)).sum().add((model.b * c[12:]).sum()).backward()
        dl.step()
        params.append(_flat(model))
        flags.append((dl.last_stats.get("launched", False), dl.last_stats["synced"], dl.last_stats["bytes_sent"] > 0))
    return params, flags


@pytest.mark.parametrize("tau", [1, 2, H])
def test_overlapped_steps_follow_the_rule_by_hand_bit_for_bit(tau):
    """4 ranks, H = 3, dense exchange, outer SGD lr 1: after every step each rank's parameters equal the
    reference's exactly; an exchange starts every H steps and is applied tau steps later (its bytes
    counted there); the ranks' mean is at every step that of pure local steps (an apply exchanges only
    the deviations from it: no step is lost or counted twice)."""
    P = 4
    ref = _reference(P, tau)
    alone = _reference(P, STEPS + 1)  # (no exchange is ever applied)
    results = ss.run_local(_run, P, tau, backend="gloo", timeout=120)
    for step in range(STEPS):
        assert torch.equal(sum(r[0][step] for r in results) / P, sum(alone[step]) / P), step
    for rank, (params, flags) in enumerate(results):
        for step, got in enumerate(params):
            assert torch.equal(got, ref[step][rank]), (tau, rank, step, (got - ref[step][rank]).abs().max())
        assert [f[0] for f in flags] == [(s + 1) % H == 0 for s in range(STEPS)]
        applied = [s >= H and (s + 1 - tau) % H == 0 for s in range(STEPS)]
        assert [f[1] for f in flags] == applied and [f[2] for f in flags] == applied
    assert not torch.equal(ref[H + tau - 1][0], ref[H + tau - 1][1])  # ranks differ right after an apply



# ------------------------------------------------------------------ sparse: consistency and resume
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))


def _resume(comm, reducer, opts, Hs=4, tau=2, steps=13, cut=5):
    torch.set_num_threads(1)

    def build(seed):
        model = _model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, ss.DiLoCo(model, comm, opt, sync_every=Hs, reducer=reducer, density=0.05, overlap=tau,
                                     **opts)

    model, opt, dl = build(0)
    shared_same = []
    for step in range(steps):
        classify_step(model, dl, step, comm.rank)
        if dl.last_stats["synced"]:
            s = dl.groups[0].shared
            shared_same.append(all(torch.equal(v, s) for v in comm.allgather(s.clone())))
    straight = _flat(model)

    model, opt, dl = build(0)
    for step in range(cut):
        classify_step(model, dl, step, comm.rank)
    in_flight = dl.overlap.pending is not None
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": dl.state_dict()}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    model, opt, dl = build(7)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["opt"])
    dl.load_state_dict(blob["diloco"])
    for step in range(cut, steps):
        classify_step(model, dl, step, comm.rank)
    return in_flight, shared_same, torch.equal(straight, _flat(model))


def _resume_all(comm):
    return {r: _resume(comm, r, o) for r, o in (("dense", {}), ("sparseloco", {"value_bits": 2, "ef_decay": 0.95}))}


def test_sparse_overlap_agrees_across_ranks_and_resumes_bitwise_with_an_exchange_in_flight():
    """AdamW inner steps, H = 4, overlap 2: after every apply all ranks hold bitwise the same shared
    parameters; a run cut after 5 steps (an exchange in flight) and resumed into fresh objects ends
    bitwise where the uninterrupted run ends, for dense and SparseLoCo (its residual in the state)."""
    for by_reducer in ss.run_local(_resume_all, 3, backend="gloo", timeout=180):
        for reducer, (in_flight, shared_same, same) in by_reducer.items():
            assert in_flight and len(shared_same) == 2 and all(shared_same), (reducer, shared_same)
            assert same, reducer


# ------------------------------------------------------------------ options
@pytest.mark.parametrize("overlap,H,reducer,msg", [
    (-1, 4, "dense", ">= 0"), (True, 4, "dense", ">= 0"), (5, 4, "dense", "at most sync_every"),
    (1, "auto", "dense", "fixed sync_every"), (1, 4, "topka", "one collective posted without waiting .*'topka'"),
])
def test_bad_overlaps_are_one_line_errors(overlap, H, reducer, msg):
    with pytest.raises(ValueError, match=msg):
        check_overlap(overlap, H, reducer)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=msg):  # before any communicator is touched: comm None is never resolved
        ss.DiLoCo(model, None, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=H, reducer=reducer,
                  overlap=overlap)


def test_an_exchange_in_flight_is_refused_by_a_diloco_without_overlap():
    from sparsync.threadcomm import ThreadWorld

    comm = ThreadWorld(1).comms()[0]
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    dla = ss.DiLoCo(a, comm, torch.optim.SGD(a.parameters(), lr=0.1), sync_every=2, overlap=2)
    dlb = ss.DiLoCo(b, comm, torch.optim.SGD(b.parameters(), lr=0.1), sync_every=2)
    for _ in range(2):
        a(torch.ones(1, 4)).sum().backward()
        dla.step()
    state = dla.state_dict()
    assert state["in_flight"] is not None
    with pytest.raises(ValueError, match="overlap=0"):
        dlb.load_state_dict(state)



def _flushed(comm):
    torch.set_num_threads(1)
    model = _Linear()
    dl = ss.DiLoCo(model, comm, torch.optim.SGD(model.parameters(), lr=LR), sync_every=H, outer_lr=1.0,
                   outer_momentum=0.0, overlap=H)
    for step in range(H):
        c = _coeff(step, comm.rank)
        dl.zero_grad()
        (model.w * c[:12].view(3, 4)).sum().add((model.b * c[12:]).sum()).backward()
        dl.step()
    before = _flat(model)
    flushed, again = dl.flush(), dl.flush()
    return before, _flat(model), flushed, again, dl.in_sync


def test_flush_applies_the_exchange_in_flight():
    """Right after an exchange starts (no step since), ``flush()`` applies it: every rank then holds the
    average of the ranks' parameters before it (plain averaging) and ``in_sync`` says so; a second flush
    has nothing to apply."""
    res = ss.run_local(_flushed, 4, backend="gloo", timeout=60)
    mean = sum(r[0] for r in res) / 4
    for before, after, flushed, again, in_sync in res:
        assert flushed and not again and in_sync
        assert torch.equal(after, mean) and not torch.equal(before, mean)
