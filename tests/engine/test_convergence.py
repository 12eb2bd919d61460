"""GradientPolicy (sparsync.convergence): DGC's momentum correction, masking, warm-up and clipping.

Exactness tests use small-integer gradients and momentum 0.5, so every sum is exact in fp32 and the
identities can be checked with ``torch.equal``, not a tolerance.
"""

import math

import pytest
import torch

import sparsync as ss
from sparsync.convergence import GradientPolicy, policy_from_options
from sparsync.reducers.registry import load_all

SPARSE = sorted(r for r in load_all() if r != "dense")


def _step(pol, r, key, g, t, target):
    """One group's reduce the way the engine does it (iface.md)."""
    r.density = pol.density(t, target)
    v = pol.before_reduce(key, g, r)
    fed = v.clone()
    out = r.reduce(v)
    pol.after_reduce(key, r)
    return fed, out


def _conservation(comm, name, masking, steps=5, n=2048, nesterov=False):
    """Per step: the reducer's identity on what it was fed (the velocity, or Nesterov's ``g + m u``),
    and the velocity update rule, exactly."""
    torch.manual_seed(1000 + comm.rank)
    r = ss.make_reducer(name, comm, 0.05, **({"residuals": "global"} if name == "gtopk" else {}))
    if not r.conserving:
        return "skip"
    pol = GradientPolicy(momentum=0.5, masking=masking, warmup_steps=3, warmup_start=0.5, nesterov=nesterov)
    zeros = torch.zeros(n)
    total_fed, total_out = torch.zeros(n), torch.zeros(n)
    for t in range(steps):
        g = torch.randint(-8, 9, (n,)).float()
        u_before = pol.velocity.get(0, zeros).clone()
        e_before = zeros if r.residual is None else r.residual.clone()
        fed, out = _step(pol, r, 0, g.clone(), t, 0.05)
        e_after = zeros if r.residual is None else r.residual
        u_new = 0.5 * u_before + g  # momentum correction: u' = m u + g
        assert torch.equal(fed, g + 0.5 * u_new if nesterov else u_new)
        assert torch.equal(comm.allreduce(fed + e_before), out + comm.allreduce(e_after))
        expect_u = u_new * (e_after != 0) if masking else u_new
        assert torch.equal(pol.velocity[0], expect_u)
        total_fed += fed
        total_out += out
    if not masking:  # telescoped: every bit of every rank's velocity was sent or is still pending
        assert torch.equal(comm.allreduce(total_fed), total_out + comm.allreduce(e_after))
    return "ok"


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("P", [2, 4])
def test_momentum_correction_conserving_every_reducer(P, masking, nesterov):
    checked = []
    for name in sorted(load_all()):
        res = ss.run_local(_conservation, P, name, masking, nesterov=nesterov)
        if res[0] == "ok":
            checked.append(name)
    assert {"dense", "micro", "topka", "cltk", "spardl"} <= set(checked)


@pytest.mark.parametrize("nesterov", [False, True])
def test_dense_momentum_correction_is_momentum_sgd(nesterov):
    """density 1, no masking: SGD on the averaged corrected velocity == torch momentum SGD (with
    ``nesterov``: == torch's Nesterov SGD, whose update is ``g + m buf``)."""

    def body(comm):
        torch.manual_seed(7 + comm.rank)
        r = ss.make_reducer("dense", comm, 1.0)
        pol = GradientPolicy(momentum=0.5, masking=False, nesterov=nesterov)
        w_pol = torch.zeros(64)
        w_ref = torch.zeros(64, requires_grad=True)
        opt = torch.optim.SGD([w_ref], lr=0.25, momentum=0.5, nesterov=nesterov)
        for t in range(6):
            g = torch.randint(-8, 9, (64,)).float()
            _, out = _step(pol, r, 0, g.clone(), t, 1.0)
            w_pol -= 0.25 * (out / comm.world_size)
            w_ref.grad = comm.allreduce(g) / comm.world_size
            opt.step()
        return torch.equal(w_pol, w_ref.detach())

    assert ss.run_local(body, 2) == [True, True]


def test_density_warmup_schedule():
    pol = GradientPolicy(warmup_steps=10, warmup_start=0.25)
    ds = [pol.density(t, 0.01) for t in range(15)]
    assert ds[0] == 0.25 and ds[10:] == [0.01] * 5
    assert all(a > b for a, b in zip(ds[:10], ds[1:11]))  # strictly decreasing to the target
    assert math.isclose(ds[5], math.sqrt(0.25 * 0.01))  # geometric mean half-way
    assert GradientPolicy().density(0, 0.02) == 0.02
    assert GradientPolicy(warmup_steps=5, warmup_start=0.01).density(0, 0.1) == 0.1  # never below target


def test_local_clipping_threshold_scaled_by_sqrt_p():
    def body(comm):
        r = ss.make_reducer("topka", comm, 0.1)
        pol = GradientPolicy(clip=1.0)
        big = torch.full((100,), 1.0)  # norm 10
        small = torch.full((100,), 0.01)  # norm 0.1
        a = pol.before_reduce(0, big.clone(), r)
        b = pol.before_reduce(1, small.clone(), r)
        return float(a.norm()), torch.equal(b, small)

    for norm, untouched in ss.run_local(body, 4):
        assert norm == pytest.approx(0.5, rel=1e-5) and untouched  # 1 / sqrt(4)


def test_bad_options_named():
    with pytest.raises(ValueError, match="momentum"):
        GradientPolicy(momentum=1.5)
    with pytest.raises(ValueError, match="masking=True needs momentum"):
        GradientPolicy(masking=True)
    with pytest.raises(ValueError, match="warmup_start"):
        GradientPolicy(warmup_steps=3, warmup_start=0)
    with pytest.raises(ValueError, match="clip"):
        GradientPolicy(clip=-1)
    with pytest.raises(ValueError, match="unknown convergence option.*momentun"):
        policy_from_options({"momentun": 0.9})
    assert policy_from_options({}) is None
    with pytest.raises(ValueError, match="nesterov=True needs momentum"):
        GradientPolicy(nesterov=True)
    with pytest.raises(ValueError, match="nesterov must be True or False"):
        GradientPolicy(momentum=0.9, nesterov="yes")
    pol = GradientPolicy(momentum=0.9)
    with pytest.raises(ValueError, match="different options.*momentum"):
        pol.load_state_dict(GradientPolicy(momentum=0.5).state_dict())
    with pytest.raises(ValueError, match="different options.*nesterov"):
        pol.load_state_dict(GradientPolicy(momentum=0.9, nesterov=True).state_dict())
    old = GradientPolicy(momentum=0.9).state_dict()  # saved before the option existed
    del old["options"]["nesterov"]
    pol.load_state_dict(old)


# ---------------------------------------------------------------------------- gloo, a real model
def _train(comm, reducer, steps, split, opts):
    """A tiny MLP trained with flat-gradient reduce + policy (the engine's calls, by hand), with a
    checkpoint/restore of every piece of state after ``split`` steps; returns the flat parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    params = list(model.parameters())

    def fresh():
        return ss.make_reducer(reducer, comm, 0.02), GradientPolicy(**opts)

    r, pol = fresh()
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(123 + comm.rank)
    for t in range(steps):
        if t == split:  # resume: everything rebuilt from state dicts
            blob = {"r": r.state_dict(), "pol": pol.state_dict(), "opt": opt.state_dict()}
            r, pol = fresh()
            r.load_state_dict(blob["r"])
            pol.load_state_dict(blob["pol"])
            opt.load_state_dict(blob["opt"])
        x = torch.randn(8, 16, generator=gen)
        y = torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        _, out = _step(pol, r, 0, flat, t, 0.02)
        for p, piece in zip(params, torch.split(out / comm.world_size, [p.numel() for p in params])):
            p.grad.copy_(piece.view_as(p))
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


ALL_ON = {"momentum": 0.9, "masking": True, "warmup_steps": 4, "warmup_start": 0.5, "clip": 0.5}


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("reducer", ["micro", "topka"])
def test_gloo_bitwise_across_ranks_and_resume(P, reducer, nesterov):
    opts = {**ALL_ON, "nesterov": nesterov}
    whole = ss.run_local(_train, P, reducer, 10, -1, opts, backend="gloo", timeout=120)
    resumed = ss.run_local(_train, P, reducer, 10, 5, opts, backend="gloo", timeout=120)
    assert all(torch.equal(w, whole[0]) for w in whole + resumed)
    plain = ss.run_local(_train, P, reducer, 10, -1, {}, backend="gloo", timeout=120)
    assert not torch.equal(plain[0], whole[0])  # the options did change the trajectory


def test_regroup_carries_velocity_per_parameter():
    pol = GradientPolicy(momentum=0.5, masking=False)
    numels = [2, 3, 4]
    pol.velocity = {0: torch.tensor([1.0, 2, 3, 4, 5]), 1: torch.tensor([6.0, 7, 8, 9])}  # groups [0,1], [2]
    pol.on_regroup([[0, 1], [2]], [[2, 0], [1]], numels)
    assert torch.equal(pol.velocity[0], torch.tensor([6.0, 7, 8, 9, 1, 2]))
    assert torch.equal(pol.velocity[1], torch.tensor([3.0, 4, 5]))


@pytest.mark.parametrize("name", ["micro", "topka", "cltk", "spardl"])
def test_reducers_follow_a_density_changed_between_steps(name):
    """The engine sets ``reducer.density`` before each step (warm-up): the achieved density follows."""

    def body(comm):
        torch.manual_seed(comm.rank)
        r = ss.make_reducer(name, comm, 0.2)
        got = []
        for t in range(10):
            r.density = 0.05 if t < 5 else 0.01
            r.reduce(torch.randn(20000))
            got.append(r.stats["density"])
        return got

    got = ss.run_local(body, 2)[0]
    assert got[-1] == pytest.approx(0.01, rel=0.3) and got[4] > 0.03
