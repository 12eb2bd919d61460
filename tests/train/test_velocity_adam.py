"""Error feedback on the momentum under AdamW (:mod:`sparsync.velocity_adam`, 1-bit Adam's scheme):
the optimizer fed the averaged velocity equals AdamW with a frozen second moment fed the averaged
gradient; through SparseDDP the velocity exchange conserves, and parameters are bitwise equal across
gloo ranks and after a resume (in the warm-up and after the freeze)."""

import math
from types import SimpleNamespace

import pytest
import torch

import sparsync as ss
from sparsync.adam import FrozenVarianceAdamW
from sparsync.convergence import GradientPolicy
from sparsync.train.optim import lr_factor, make_optimizer
from sparsync.velocity_adam import VelocityAdamW

#: float tolerance of "equals": U_t - b1 U_{t-1} and (1 - b1) U_t round differently from AdamW's lerp
TOL = 1e-6


def _pair(seed=0):
    torch.manual_seed(seed)
    base = [torch.randn(6, 5), torch.randn(5)]
    return ([torch.nn.Parameter(p.clone()) for p in base], [torch.nn.Parameter(p.clone()) for p in base])


def test_fed_the_exact_velocity_it_is_frozen_variance_adamw():
    """``p.grad = U_t = g_t + 0.9 U_{t-1}``: the same parameters as FrozenVarianceAdamW fed ``g_t``,
    before the freeze (second moment from the recovered gradient) and after it, schedule included."""
    a, b = _pair()
    oa = FrozenVarianceAdamW(a, lr=1e-2, weight_decay=0.1, freeze_after=5)
    ob = VelocityAdamW(b, lr=1e-2, weight_decay=0.1, freeze_after=5)
    plain, _ = _pair()
    op = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    vel = [torch.zeros_like(p) for p in a]
    gen = torch.Generator().manual_seed(3)
    for t in range(15):
        for o in (oa, ob, op):
            for grp in o.param_groups:
                grp["lr"] = 1e-2 * lr_factor(t, 15, 3, "cosine")
        for i, (pa, pb, pp) in enumerate(zip(a, b, plain)):
            g = torch.randn(pa.shape, generator=gen)
            vel[i] = g + 0.9 * vel[i]
            pa.grad, pb.grad, pp.grad = g.clone(), vel[i].clone(), g.clone()
        oa.step(), ob.step(), op.step()
        assert max(float((x - y).detach().abs().max()) for x, y in zip(a, b)) <= TOL, t
        assert ("velocity_prev" in ob.state[b[0]]) == (t < 5)  # kept for the warm-up only
    assert max(float((x - y).detach().abs().max()) for x, y in zip(plain, b)) > 100 * TOL  # the freeze did change it


def _cfg(**kw):
    d = {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "adam_freeze": 3, "convergence": {}}
    d.update(kw)
    return SimpleNamespace(**d)


def _train(comm, reducer, density, policy_opts, freeze, steps=10, split=-1, probe=False):
    """A tiny MLP through SparseDDP with the trainer's optimizer (``make_optimizer``), optionally
    rebuilt from state dicts after ``split`` steps. Returns the flat parameters (and, with ``probe``,
    the conservation check's two sides)."""
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))
    init = torch.Generator().manual_seed(0)  # not the global RNG: thread ranks share it
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=init))
    cfg = _cfg(adam_freeze=freeze, convergence=dict(policy_opts))

    def build():
        pol = GradientPolicy(**policy_opts) if policy_opts else None
        ddp = ss.SparseDDP(model, comm, reducer=reducer, density=density, merge="single", policy=pol)
        return ddp, make_optimizer(cfg, model.parameters())

    ddp, opt = build()
    gen = torch.Generator().manual_seed(50 + comm.rank)
    n = sum(p.numel() for p in model.parameters())
    sent, fed = torch.zeros(n), torch.zeros(n)
    for t in range(steps):
        if t == split:
            blob = {"m": {k: v.clone() for k, v in model.state_dict().items()}, "o": opt.state_dict(),
                    "e": ddp.sparsync_state_dict()}
            ddp.close()
            ddp, opt = build()
            model.load_state_dict(blob["m"])
            opt.load_state_dict(blob["o"])
            ddp.load_sparsync_state_dict(blob["e"])
        x, y = torch.randn(5, 12, generator=gen), torch.randint(0, 3, (5,), generator=gen)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()  # the engine's reduce has completed when the optimizer reads .grad
        if probe:
            params = list(model.parameters())  # in the merge group's layout, as velocity and residual are
            sent += torch.cat([params[i].grad.reshape(-1) for i in ddp._engine.groups[0]])
            fed += ddp._engine.policy.velocity[0]
    ddp.close()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not probe:
        return params
    res = ddp._engine.reducers[0].residual
    P = comm.world_size
    # every rank's velocity was either applied (averaged) or is still in some rank's residual
    return params, comm.allreduce(fed.clone()) / P, sent + comm.allreduce(res.clone()) / P


def test_density_one_through_sparse_ddp_is_dense_frozen_variance_adamw():
    """The lossless exchange + momentum correction + VelocityAdamW == the same exchange of gradients +
    FrozenVarianceAdamW (the trainer's pieces: GradientPolicy, SparseDDP, make_optimizer)."""
    mom = ss.run_local(_train, 2, "dense", 1.0, {"momentum": 0.9, "masking": False}, 4)
    ref = ss.run_local(_train, 2, "dense", 1.0, {}, 4)
    assert torch.allclose(mom[0], ref[0], rtol=0, atol=TOL)
    other = ss.run_local(_train, 2, "dense", 1.0, {}, 0)  # plain AdamW: the freeze matters here
    assert not torch.allclose(other[0], ref[0], rtol=0, atol=1e-4)


@pytest.mark.gloo
@pytest.mark.parametrize("split", [2, 6])
def test_sparse_momentum_exchange_conserves_bitwise_across_ranks_and_resumes(split):
    opts = {"momentum": 0.9, "masking": False, "dense_steps": 3}
    whole = ss.run_local(_train, 3, "micro", 0.05, opts, 3, 10, -1, True, backend="gloo", timeout=120)
    for params, fed, sent in whole:
        assert torch.equal(params, whole[0][0])
        assert torch.allclose(fed, sent, rtol=0, atol=1e-5 * float(fed.abs().max()))
        assert float((fed - sent).abs().max()) < float(fed.abs().max())  # something was left to send
    resumed = ss.run_local(_train, 3, "micro", 0.05, opts, 3, 10, split, backend="gloo", timeout=120)
    assert all(torch.equal(p, whole[0][0]) for p in resumed)


def test_trainer_accepts_it_only_with_what_it_needs(tmp_path):
    from sparsync.train.loop import validate
    from sparsync.train.runs import TrainConfig

    def cfg(conv, **kw):
        d = {"workload": "digits-mlp", "workload_options": {"width": 16}, "reducer": "micro", "density": 0.05,
             "workers": 2, "steps": 4, "runs_dir": str(tmp_path), "network": "thread", "progress": False,
             "optimizer": "adamw", "convergence": conv}
        d.update(kw)
        c = TrainConfig(**d)
        validate(c)
        return c

    ok = cfg({"momentum": 0.9, "dense_steps": 2}, adam_freeze=2)
    assert ok.convergence["masking"] is False  # off by default under adamw
    assert isinstance(make_optimizer(ok, torch.nn.Linear(2, 2).parameters()), VelocityAdamW)
    for conv, kw, msg in [({"momentum": 0.9}, {}, "needs adam_freeze=N"),
                          ({"momentum": 0.9, "dense_steps": 1}, {"adam_freeze": 2}, r"dense_steps >= adam_freeze"),
                          ({"momentum": 0.9, "dense_steps": 2, "masking": True}, {"adam_freeze": 2}, "masking=false"),
                          ({"momentum": 0.9}, {"optimizer": "adam"}, "does not apply to --optimizer adam")]:
        with pytest.raises(ValueError, match=msg) as e:
            cfg(conv, **kw)
        assert "\n" not in str(e.value)
    assert math.isclose(make_optimizer(ok, [torch.zeros(1, requires_grad=True)]).defaults["betas"][0], 0.9)
