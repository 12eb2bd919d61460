"""ss.DiLoCo on real gloo ranks: H = 1 is synchronous DDP SGD, the sparse pseudo-gradient exchange
conserves what it does not send, every rank holds bitwise the same parameters after each outer step,
and a checkpoint taken in the middle of an outer cycle resumes bitwise."""

import io

import pytest
import torch

import sparsync as ss

SPARSE = ("micro", "topka")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _train_step(model, opt_like, step, rank):
    x, y = _batch(step, rank)
    opt_like.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt_like.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _gathered(comm, t):
    return [x.clone() for x in comm.allgather(t.clone())]


# ------------------------------------------------------------------ H = 1 is synchronous DDP SGD
def _h1_vs_ddp(comm):
    torch.set_num_threads(1)
    a, b = _model(), _model()
    dl = ss.DiLoCo(a, comm, torch.optim.SGD(a.parameters(), lr=0.1), sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    ddp = torch.nn.parallel.DistributedDataParallel(b)
    opt_b = torch.optim.SGD(ddp.parameters(), lr=0.1)
    start = _flat(b)
    gaps = []
    for step in range(8):
        _train_step(a, dl, step, comm.rank)
        x, y = _batch(step, comm.rank)
        opt_b.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt_b.step()
        gaps.append(float((_flat(a) - _flat(b)).abs().max()))
    return gaps, float((_flat(b) - start).abs().max())


def test_h1_outer_lr1_no_momentum_is_synchronous_ddp_sgd():
    """delta_r = shared - (shared - lr g_r) equals lr g_r up to one rounding of the subtraction: the
    parameters follow torch DDP + SGD within 2e-6 (absolute; parameters are O(0.5)) over 8 steps,
    while the training moves them by far more than that."""
    for gaps, moved in ss.run_local(_h1_vs_ddp, 3, backend="gloo", timeout=120):
        assert moved > 1e-2
        assert max(gaps) <= 2e-6, gaps


# ------------------------------------------------------------------ consistency and conservation
def _outer_steps(comm, reducer, H=3, cycles=3):
    """Per outer step: conservation error, bitwise agreement of all ranks, whether ranks differed just
    before the sync, topka's count of entries that left the residual."""
    torch.set_num_threads(1)
    model = _model(seed=comm.rank)  # different seeds: DiLoCo's init_sync must make them equal
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dl = ss.DiLoCo(model, comm, opt, sync_every=H, reducer=reducer, density=0.05)
    g, P = dl.groups[0], comm.world_size
    out = []
    step = 0
    for _ in range(cycles):
        for _ in range(H - 1):
            _train_step(model, dl, step, comm.rank)
            step += 1
        x, y = _batch(step, comm.rank)
        dl.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        dl.inner_optimizer.step()  # the inner step of the sync call, taken apart to see the pseudo-gradient
        delta = g.shared - _flat(model)
        before = torch.zeros_like(delta) if g.reducer.residual is None else g.reducer.residual.clone()
        differed = any(not torch.equal(v, _flat(model)) for v in _gathered(comm, _flat(model)))
        dl.inner_step += 1
        dl.sync()
        step += 1
        total = g.average * P  # exact: P is a power of two
        after = torch.zeros_like(delta) if g.reducer.residual is None else g.reducer.residual
        # conservation, summed over ranks in rank order: sum(delta + before) == out + sum(after)
        lhs = torch.stack(_gathered(comm, delta + before)).sum(0)
        rhs = total + torch.stack(_gathered(comm, after)).sum(0)
        err = float((lhs - rhs).abs().max() / lhs.abs().max())
        sent = int(((delta + before) != after).sum())  # entries whose value left the residual
        same = all(torch.equal(v, _flat(model)) for v in _gathered(comm, _flat(model)))
        out.append({"err": err, "same": same, "differed": differed, "sent": sent, "k": g.reducer.stats["selected"],
                    "held": float(after.abs().sum()),
                    "shared_is_params": torch.equal(g.shared, _flat(model))})
    return out


def _outer_steps_all(comm):
    return {r: _outer_steps(comm, r) for r in ("dense", *SPARSE)}


def test_pseudo_gradient_exchange_conserves_and_ranks_agree_bitwise():
    """Over three outer steps with the residual carried from one to the next (fp16 values, DiLoCo's
    default for these reducers): what the ranks put in (pseudo-gradient + residual) equals the sum
    they received plus what stays in their residuals (to fp32 summation rounding, 1e-6 relative),
    something is held back every time, and after every outer step all ranks hold bitwise the same
    parameters (which differed just before it)."""
    for by_reducer in ss.run_local(_outer_steps_all, 4, backend="gloo", timeout=120):
        for reducer, rows in by_reducer.items():
            for row in rows:
                assert row["err"] <= 1e-6, (reducer, row)
                assert row["same"] and row["differed"] and row["shared_is_params"], (reducer, row)
                assert (row["held"] > 0) == (reducer != "dense"), (reducer, row)  # dense keeps nothing back
            if reducer == "topka":  # local exact top-k: only the sent entries leave the residual, the rest stay exactly
                assert all(0 < row["sent"] <= row["k"] for row in rows), rows


# ------------------------------------------------------------------ bitwise resume mid-cycle
def _resume(comm, reducer, H=4, steps=11, cut=6):
    torch.set_num_threads(1)

    def build(seed):
        model = _model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        return model, opt, ss.DiLoCo(model, comm, opt, sync_every=H, reducer=reducer, density=0.05)

    model, opt, dl = build(0)
    for step in range(steps):
        _train_step(model, dl, step, comm.rank)
    straight = _flat(model)

    model, opt, dl = build(0)
    for step in range(cut):
        _train_step(model, dl, step, comm.rank)
    assert 0 < dl.inner_step < H  # the middle of an outer cycle
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": dl.state_dict()}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)  # tensors and plain data only: no process group inside
    model, opt, dl = build(7)  # other initial values everywhere, overwritten by the checkpoint
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["opt"])
    dl.load_state_dict(blob["diloco"])
    for step in range(cut, steps):
        _train_step(model, dl, step, comm.rank)
    return torch.equal(straight, _flat(model)), float((straight - _flat(model)).abs().max())


def _resume_all(comm):
    return {r: _resume(comm, r) for r in ("dense", *SPARSE)}


def test_resume_from_the_middle_of_an_outer_cycle_is_bitwise():
    """dense and two sparse reducers (their residuals in the state): a run cut after 6 steps (H = 4)
    and resumed into freshly built objects ends bitwise where the uninterrupted run ends."""
    for by_reducer in ss.run_local(_resume_all, 2, backend="gloo", timeout=120):
        for reducer, (same, gap) in by_reducer.items():
            assert same, (reducer, gap)


def test_state_dict_mismatches_are_refused():
    from sparsync.threadcomm import ThreadWorld

    c = ThreadWorld(1).comms()[0]
    m = _model()
    dl = ss.DiLoCo(m, c, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=4)
    sd = dl.state_dict()
    with pytest.raises(ValueError, match="sync_every=4"):
        ss.DiLoCo(m, c, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=8).load_state_dict(sd)
    with pytest.raises(ValueError, match="not a DiLoCo state dict"):
        dl.load_state_dict({"format": "x"})
    for bad, msg in (({"sync_every": 0}, "sync_every"), ({"sync_every": 2, "outer_lr": 0}, "outer_lr"),
                     ({"sync_every": 2, "outer_momentum": 1.0}, "outer_momentum"),
                     ({"sync_every": 2, "reducer": "nosuch"}, "nosuch")):
        with pytest.raises((ValueError, KeyError, TypeError), match=msg):
            ss.DiLoCo(m, c, torch.optim.SGD(m.parameters(), lr=0.1), **bad)
