"""SparseDDP on real gloo ranks: equals torch DDP with the dense reducer, keeps ranks identical with every
reducer, resumes bitwise, and the torch-DDP comm-hook adapter works."""

import copy

import pytest
import torch
from torch import nn

import sparsync as ss
from sparsync.reducers.registry import load_all

MERGES = ["single", "wfbp", "buckets:0.002", "optimal", "mgwfbp"]
SPARSE_RUNS = [("topka", "buckets:0.002"), ("topka", "mgwfbp"), ("micro", "wfbp"), ("micro", "optimal")]


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)


def _flat_params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _flat_grads(m):
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def _sgd_steps(net, opt, rank, steps, start=0):
    """``steps`` optimizer steps of ``net`` (a SparseDDP or DDP model) on this rank's batches."""
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def _suite(comm):
    """Everything that needs one gloo world of this size, batched into one set of processes."""
    import torch.distributed as dist

    out = {}
    ref = nn.parallel.DistributedDataParallel(_model(comm.rank + 50))  # rank-dependent init: both broadcast
    # 1. dense SparseDDP gradients == torch DDP's averaged gradients, for every merge strategy,
    #    across several batches (mgwfbp/optimal switch plans after 3 profiled steps)
    worst = 0.0
    for merge in MERGES:
        m = _model(comm.rank + 50)
        ddp = ss.SparseDDP(m, comm, reducer="dense", merge=merge, profile_warmup=1, profile_steps=2)
        assert torch.equal(_flat_params(m), _flat_params(ref.module)), "parameters not broadcast from rank 0"
        for step in range(5):
            x, y = _batch(comm.rank, step)
            ref.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            m.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            a, b = _flat_grads(m), _flat_grads(ref.module)
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (merge, step, (a - b).abs().max())
            worst = max(worst, float((a - b).abs().max()))
        st = ddp.last_stats
        assert st["numel"] == a.numel() and st["density"] == 1.0 and st["groups"] >= 1
        for k in ("select_s", "comm_s", "wait_s", "backward_s", "bytes_sent", "bytes_received", "selected"):
            assert k in st
        out[f"plan/{merge}"] = ddp.groups
        ddp.close()
    out["max_abs_diff_vs_ddp"] = worst
    # 2. sparse reducers through SparseDDP under fixed and switching plans (topka: dense write-back;
    #    micro: the indexed write-back that clears only last step's non-zeros), from rank-dependent
    #    initial parameters: after SGD steps (past the plan switch) parameters are bitwise identical
    for name, merge in SPARSE_RUNS:
        m = _model(comm.rank + 50)
        ddp = ss.SparseDDP(m, comm, reducer=name, density=0.1, merge=merge, profile_warmup=1, profile_steps=2)
        _sgd_steps(ddp, torch.optim.SGD(m.parameters(), lr=0.05), comm.rank, 5)
        out[f"params/{name}/{merge}"] = _flat_params(m)
        ddp.close()
    # 3. torch DDP + ss.ddp_hook: dense hook == default DDP; topka hook keeps ranks identical
    m1 = nn.parallel.DistributedDataParallel(copy.deepcopy(ref.module))
    m1.register_comm_hook(None, ss.ddp_hook("dense"))
    x, y = _batch(comm.rank, 99)
    nn.functional.mse_loss(m1(x), y).backward()
    ref.zero_grad()
    nn.functional.mse_loss(ref(x), y).backward()
    assert torch.allclose(_flat_grads(m1.module), _flat_grads(ref.module), rtol=1e-5, atol=1e-7)
    m2 = nn.parallel.DistributedDataParallel(_model(8))
    hook = ss.ddp_hook("topka", density=0.2, module=m2)
    m2.register_comm_hook(None, hook)
    opt = torch.optim.SGD(m2.parameters(), lr=0.05)
    _sgd_steps(m2, opt, comm.rank, 5)
    hs = copy.deepcopy(hook.state_dict())
    assert hs["buckets"] and all(b["state"]["residual"] is not None for b in hs["buckets"].values())
    assert sorted(hs["per_param"]) == list(range(len(list(m2.parameters()))))
    # hook state round trip: a fresh DDP + hook loaded from the state continues identically
    m3 = nn.parallel.DistributedDataParallel(copy.deepcopy(m2.module))
    h3 = ss.ddp_hook("topka", density=0.2)
    h3.load_state_dict(hs)
    m3.register_comm_hook(m3, h3)  # the DDP model as state: its parameters give the layout
    opt3 = torch.optim.SGD(m3.parameters(), lr=0.05)
    x, y = _batch(comm.rank, 5)
    for model, o in ((m2, opt), (m3, opt3)):
        o.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        o.step()
    assert torch.equal(_flat_params(m2.module), _flat_params(m3.module))
    out["hook_params"] = _flat_params(m2.module)
    dist.barrier()
    return out


def _every_reducer(comm, name):
    m = _model(comm.rank)
    ddp = ss.SparseDDP(m, comm, reducer=name, density=0.1, merge="buckets:0.002")
    _sgd_steps(ddp, torch.optim.SGD(m.parameters(), lr=0.05), comm.rank, 20)
    out = {"params": _flat_params(m), "density": ddp.last_stats["density"], "groups": ddp.last_stats["groups"]}
    ddp.close()
    return out


def _all_reducers(comm, names):
    return {n: _every_reducer(comm, n) for n in names}


def _check_identical(res, names, P, backend):
    for name in names:
        for r in range(1, P):
            assert torch.equal(res[0][name]["params"], res[r][name]["params"]), \
                f"{name}: {backend} P={P}: rank {r} parameters differ from rank 0 after 20 steps"
        assert 0 < res[0][name]["density"] <= 1.0 and res[0][name]["groups"] > 1


@pytest.mark.gloo
def test_every_reducer_keeps_ranks_identical_gloo():
    """20 SGD steps through SparseDDP (several groups) leave parameters bitwise identical on every rank,
    for every registered reducer (4 real gloo ranks, one world for all reducers)."""
    names = sorted(load_all())
    res = ss.run_local(_all_reducers, 4, names, backend="gloo", timeout=120)
    _check_identical(res, names, 4, "gloo")


def test_every_reducer_keeps_ranks_identical_thread_p3():
    """Same on 3 thread ranks (a non-power of two); reducers that reject P=3 at construction are listed."""
    from sparsync.threadcomm import ThreadWorld

    names, rejected = [], []
    for n in sorted(load_all()):
        try:
            ss.make_reducer(n, ThreadWorld(3).comms()[0], 0.1)
            names.append(n)
        except ValueError as e:
            assert "P=3" in str(e) or "world size" in str(e) or "power" in str(e), (n, e)
            rejected.append(n)
    res = ss.run_local(_all_reducers, 3, names, backend="thread", timeout=120)
    _check_identical(res, names, 3, "thread")
    assert len(rejected) <= 2, rejected


@pytest.mark.gloo
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_sparseddp_gloo_suite(P):
    res = ss.run_local(_suite, P, backend="gloo", timeout=120)
    assert res[0]["max_abs_diff_vs_ddp"] < 1e-6
    bitwise = [f"params/{name}/{merge}" for name, merge in SPARSE_RUNS] + ["hook_params"]
    plans = [f"plan/{merge}" for merge in MERGES]
    assert sorted(res[0]) == sorted(bitwise + plans + ["max_abs_diff_vs_ddp"])  # every check below runs
    for key in bitwise:
        for r in range(1, P):
            assert torch.equal(res[0][key], res[r][key]), f"{key} differs between rank 0 and rank {r}"
    for key in plans:
        assert all(r[key] == res[0][key] for r in res), f"{key}: ranks chose different plans"
    assert len(res[0]["plan/wfbp"]) == 8 and len(res[0]["plan/single"]) == 1


# ---------------------------------------------------------------------- resume
def _train(comm, name, steps, start=0, ckpt=None, merge="buckets:0.002"):
    m = _model(comm.rank)
    ddp = ss.SparseDDP(m, comm, reducer=name, density=0.1, merge=merge)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    if ckpt is not None:
        ddp.load_state_dict(ckpt["ddp"])
        opt.load_state_dict(ckpt["opt"])
    _sgd_steps(ddp, opt, comm.rank, steps, start)
    state = {"ddp": copy.deepcopy(ddp.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    ddp.close()
    return state


def _straight_and_half(comm, names):
    return {n: (_train(comm, n, 20), _train(comm, n, 10)) for n in names}


def _resume(comm, halves):
    return {n: _train(comm, n, 10, start=10, ckpt=h[comm.rank]) for n, h in halves.items()}


def _assert_same_state(a, b, what):
    """Bitwise equal, but for ``timings`` (wall-clock readings: no two runs share them; not part of
    what a bitwise resume promises)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert set(a) == set(b), what
        for k in a:
            if k != "timings":
                _assert_same_state(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


@pytest.mark.gloo
def test_resume_bitwise_every_reducer():
    # auto decides from the times it measures, which differ run to run: test_auto_reducer resumes it
    # bitwise across a decision change with injected timings
    names = sorted(n for n in load_all() if n != "auto")
    first = ss.run_local(_straight_and_half, 2, names, backend="gloo", timeout=120)
    halves = {n: [first[r][n][1] for r in range(2)] for n in names}
    resumed = ss.run_local(_resume, 2, halves, backend="gloo", timeout=120)  # fresh processes
    for n in names:
        for r in range(2):
            straight = first[r][n][0]["ddp"]
            _assert_same_state(resumed[r][n]["ddp"], straight, f"{n} rank {r}")


def _resume_after_switch(comm):
    """mgwfbp switches plans at step 3; a checkpoint taken after the switch resumes bitwise."""
    m = _model(comm.rank)
    ddp = ss.SparseDDP(m, comm, reducer="topka", density=0.1, merge="mgwfbp", profile_warmup=1, profile_steps=2,
                       cost_model=(1e-3, 1e-8))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    ckpt = None
    for step in range(12):
        if step == 6:
            ckpt = copy.deepcopy({"ddp": ddp.state_dict(), "opt": opt.state_dict()})
        x, y = _batch(comm.rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    assert ddp.engine.final and ckpt["ddp"]["_extra_state"]["final"]
    ddp.close()
    m2 = _model(comm.rank + 17)
    ddp2 = ss.SparseDDP(m2, comm, reducer="topka", density=0.1, merge="mgwfbp", cost_model=(1e-3, 1e-8))
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.05)
    ddp2.load_state_dict(ckpt["ddp"])
    opt2.load_state_dict(ckpt["opt"])
    for step in range(6, 12):
        x, y = _batch(comm.rank, step)
        opt2.zero_grad()
        nn.functional.mse_loss(ddp2(x), y).backward()
        opt2.step()
    _assert_same_state(ddp2.state_dict(), ddp.state_dict(), "after resume")
    return _flat_params(m)


def test_resume_after_plan_switch_thread():
    res = ss.run_local(_resume_after_switch, 3, backend="thread")
    assert all(torch.equal(res[0], r) for r in res)
