"""GradientPolicy through SparseDDP(policy=) and the training loop: bitwise across ranks, bitwise resume."""

import json

import pytest
import torch

import sparsync as ss
from sparsync.train.loop import launch, validate
from sparsync.train.runs import TrainConfig

ALL_ON = {"momentum": 0.9, "masking": True, "warmup_steps": 4, "warmup_start": 0.2, "clip": 1.0}


def _ddp_params(comm, reducer, merge, steps=6):
    torch.manual_seed(comm.rank)  # different initial parameters: SparseDDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48),
                                torch.nn.ReLU(), torch.nn.Linear(48, 5))
    pol = ss.GradientPolicy(**ALL_ON)
    ddp = ss.SparseDDP(model, comm, reducer=reducer, density=0.02, merge=merge, policy=pol)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(50 + comm.rank)
    dens = []
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 5, (16,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        dens.append(ddp.reducers[0].density)
    ddp.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), dens, len(pol.velocity)


@pytest.mark.gloo
@pytest.mark.parametrize("reducer,merge,P", [("micro", "single", 4), ("topka", "wfbp", 2)])
def test_sparseddp_policy_bitwise_across_ranks(reducer, merge, P):
    res = ss.run_local(_ddp_params, P, reducer, merge, backend="gloo", timeout=120)
    flat0, dens, groups = res[0]
    assert all(torch.equal(flat, flat0) for flat, _, _ in res)
    assert dens[0] == pytest.approx(0.2) and dens[-1] == pytest.approx(0.02)  # the warm-up reached the reducers
    assert groups == (1 if merge == "single" else 6)  # one velocity per merge group


def _cfg(tmp_path, name, steps, network, **kw):
    d = {"workload": "digits-mlp", "workload_options": {"width": 64}, "reducer": "micro", "density": 0.05,
         "workers": 3, "steps": steps, "eval_every": 3, "runs_dir": str(tmp_path), "name": name,
         "network": network, "progress": False, "timeout": 120, "convergence": dict(ALL_ON)}
    d.update(kw)
    cfg = TrainConfig(**d)
    validate(cfg)
    return cfg


def _losses(tmp_path, name):
    return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.gloo
def test_train_resume_bitwise_with_every_option(tmp_path, network="loopback"):
    launch(_cfg(tmp_path, "straight", 8, network))
    launch(_cfg(tmp_path, "split", 4, network))
    launch(_cfg(tmp_path, "split", 8, network), resume=True)
    assert _losses(tmp_path, "straight") == _losses(tmp_path, "split")  # velocities restored bitwise
    launch(_cfg(tmp_path, "plain", 8, network, convergence={}))
    assert _losses(tmp_path, "plain") != _losses(tmp_path, "straight")
    cfg = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert cfg["convergence"] == ALL_ON


def test_convergence_options_refused_where_they_do_not_apply(tmp_path):
    with pytest.raises(ValueError, match="apply to SparseDDP reducers, not to 'ddp-fp16'"):
        _cfg(tmp_path, "x", 2, "loopback", reducer="ddp-fp16")
    with pytest.raises(ValueError, match="not to 'nocomm'"):
        _cfg(tmp_path, "x", 2, "loopback", reducer="nocomm")
    with pytest.raises(ValueError, match="does not apply to --optimizer adam"):
        _cfg(tmp_path, "x", 2, "loopback", optimizer="adam")
    with pytest.raises(ValueError, match="unknown convergence option.*nesterv"):
        _cfg(tmp_path, "x", 2, "loopback", convergence={"nesterv": True})


def test_momentum_correction_takes_the_optimizers_kind_of_momentum(tmp_path):
    """``--optimizer nesterov``: momentum correction is Nesterov's unless told otherwise; the
    optimizer itself becomes plain SGD either way (the momentum lives in the policy)."""
    from sparsync.train.loop import policy_options
    from sparsync.train.optim import make_optimizer

    cfg = _cfg(tmp_path, "x", 2, "loopback", optimizer="nesterov")
    assert policy_options(cfg) == {**ALL_ON, "nesterov": True}
    assert make_optimizer(cfg, torch.nn.Linear(2, 2).parameters()).defaults["momentum"] == 0
    cfg = _cfg(tmp_path, "x", 2, "loopback", optimizer="nesterov", convergence={**ALL_ON, "nesterov": False})
    assert policy_options(cfg)["nesterov"] is False
    assert "nesterov" not in policy_options(_cfg(tmp_path, "x", 2, "loopback", optimizer="momentum"))
    dense = _cfg(tmp_path, "x", 2, "loopback", optimizer="nesterov", reducer="dense", convergence={})
    opt = make_optimizer(dense, torch.nn.Linear(2, 2).parameters())
    assert opt.defaults["nesterov"] and opt.defaults["momentum"] == 0.9


@pytest.mark.gloo
def test_floor_and_torch_powersgd_rows_run(tmp_path):
    """The rows make run adds: the floor exchanges nothing; PowerSGD (rank 1 and 4) runs on gloo past
    start_powerSGD_iter without the collective-order failure of torch's default buckets."""
    floor = launch(_cfg(tmp_path, "floor", 4, "loopback", reducer="nocomm", convergence={}, workers=2))
    assert floor["label"] == "no-comm floor" and floor["median_comm_s"] is None
    for rank in (1, 4):
        s = launch(_cfg(tmp_path, f"psgd{rank}", 6, "loopback", reducer=f"ddp-powersgd{rank}", convergence={},
                        workers=2, workload_options={"width": 256}))
        rows = [json.loads(x) for x in (tmp_path / f"psgd{rank}" / "metrics.jsonl").read_text().splitlines()]
        dense_bytes = 2 * (2 - 1) * s["numel"] * 4 // 2
        assert 0 < rows[-1]["bytes_sent"] < dense_bytes / 8  # compressed (ring formula on P and Q)


def _fold_params(comm, nesterov, reuse, steps=5):
    """SparseDDP + momentum correction, micro: with ``reuse_buffers`` the policy adds its output into
    the reducer's residual in its own pass (``fold_into``); without, the reducer adds it."""
    torch.manual_seed(comm.rank)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))
    pol = ss.GradientPolicy(momentum=0.9, masking=False, nesterov=nesterov, warmup_steps=2, warmup_start=0.3)
    ddp = ss.SparseDDP(model, comm, reducer="micro", density=0.05, merge="single", policy=pol,
                       reducer_options={"reuse_buffers": reuse})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(70 + comm.rank)
    calls, fold = [], pol._fold
    pol._fold = lambda *a: calls.append(1) or fold(*a)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 5, (16,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    ddp.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), len(calls)


@pytest.mark.gloo
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_fold_into_the_residual_changes_no_bit(nesterov):
    """The fused pass (C kernel, and its torch fallback) gives the parameters of the unfused one."""
    from sparsync import native

    fused = ss.run_local(_fold_params, 2, nesterov, True, backend="gloo", timeout=120)
    plain = ss.run_local(_fold_params, 2, nesterov, False, backend="gloo", timeout=120)
    assert fused[0][1] == 4 and plain[0][1] == 0  # it did fold, from step 1 on (step 0: no residual yet)
    assert all(torch.equal(f[0], plain[0][0]) for f in fused + plain)
    with native.switched_off():
        torch_fold = ss.run_local(_fold_params, 2, nesterov, True, backend="gloo", timeout=120)
    assert all(torch.equal(f[0], plain[0][0]) for f in torch_fold)
