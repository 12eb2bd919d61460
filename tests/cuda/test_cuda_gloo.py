"""CUDA over real gloo processes: every reducer, SparseDDP and its timers, state dicts between devices.

Each rank of ``ss.run_local(..., backend="gloo")`` wraps the gloo group in a
``TorchComm(device="cuda")``, so the reducers, the collectives and their buffers all work on the GPU
(several ranks share the one GPU: NCCL refuses that, gloo carries CUDA tensors). Checked as on the
CPU: the reducers' sums against the conservation identity (a dense reference), bitwise agreement of
the ranks, SparseDDP's dense gradient against the averaged gradient of an unwrapped copy, parameters
bitwise identical across ranks for every reducer, non-negative device-synchronised timings, and a
state dict saved on CUDA, loaded on the CPU and back, resuming bitwise. Marked ``cuda``: skipped (by
``conftest.py``) where torch sees no GPU.
"""

import copy
import io

import pytest
import torch
from engine.test_engine_ddp import _assert_same_state, _batch, _flat_params, _model
from torch import nn

import sparsync as ss
from sparsync.reducers.registry import load_all
from sparsync.torchcomm import TorchComm

pytestmark = [pytest.mark.cuda, pytest.mark.gloo]
NAMES = sorted(load_all())
TIMEOUT = 180


def _cuda_comm(comm) -> TorchComm:
    """This rank's gloo group with every buffer on the GPU."""
    torch.cuda.set_device(0)
    return TorchComm(device=torch.device("cuda", 0))


def _grad(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


# ---------------------------------------------------------------------- reducers
def _reducer_steps(comm, names, n, steps, density):
    cc = _cuda_comm(comm)
    out = {}
    for name in names:
        r = ss.make_reducer(name, cc, density=density)
        rows = []
        for t in range(steps):
            g = _grad(comm.rank, t, n).to(cc.device)
            before = torch.zeros(n) if r.residual is None else r.residual.cpu().clone()  # (a copy on the CPU too)
            res = r.reduce(g)
            assert res.device == cc.device, (name, res.device)
            assert r.residual is None or r.residual.device == cc.device, (name, r.residual.device)
            after = torch.zeros(n) if r.residual is None else r.residual.cpu().clone()
            rows.append((g.cpu(), before, after, res.cpu().clone(), dict(r.stats)))
        out[name] = (rows, r.conserving)
    return out


def _check_reducers(res, names, steps):
    for name in names:
        rows0, conserving = res[0][name]
        for t in range(steps):
            outs = [r[name][0][t][3] for r in res]
            for i, o in enumerate(outs[1:], 1):
                assert torch.equal(o, outs[0]), f"{name} step {t}: rank {i} disagrees with rank 0"
            if conserving:  # sum_r (grad + residual_before) == out + sum_r residual_after
                lhs = sum(r[name][0][t][0] + r[name][0][t][1] for r in res)
                rhs = outs[0] + sum(r[name][0][t][2] for r in res)
                assert torch.allclose(lhs, rhs, rtol=1e-5, atol=1e-4), (name, t, float((lhs - rhs).abs().max()))
            if name == "dense":
                assert torch.allclose(outs[0], sum(r[name][0][t][0] for r in res), rtol=1e-5, atol=1e-5)
            stats = rows0[t][4]
            times = {k: v for k, v in stats.items() if k.endswith("_s")}
            assert times and all(v >= 0 for v in times.values()), (name, times)


@pytest.mark.parametrize("name", NAMES)
def test_reducer_on_cuda_two_ranks(name):
    steps = 4
    res = ss.run_local(_reducer_steps, 2, [name], 70_001, steps, 0.05, backend="gloo", timeout=TIMEOUT)
    _check_reducers(res, [name], steps)


def test_every_reducer_on_cuda_four_ranks():
    """P = 4: sums of more than two contributions, whose order must be the same on every rank."""
    steps = 3
    res = ss.run_local(_reducer_steps, 4, NAMES, 50_003, steps, 0.02, backend="gloo", timeout=TIMEOUT)
    _check_reducers(res, NAMES, steps)


# ---------------------------------------------------------------------- SparseDDP
def _flat_grads(m):
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def _times_ok(stats) -> bool:
    return all(v >= 0 for k, v in stats.items() if k.endswith("_s") and isinstance(v, (int, float)))


def _sgd_steps(ddp, m, rank, dev, steps):
    """``steps`` SGD steps of the model wrapped by ``ddp`` on this rank's batches, on ``dev``."""
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(steps):
        x, y = (t.to(dev) for t in _batch(rank, step))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _ddp_suite(comm, names):
    cc = _cuda_comm(comm)
    dev, P = cc.device, comm.world_size
    out = {}
    # dense SparseDDP == the average of an unwrapped copy's gradients (mgwfbp profiles, then switches)
    for merge in ("single", "buckets:0.002", "mgwfbp"):
        ref = _model(50).to(dev)  # rank 0's initial parameters, which SparseDDP broadcasts
        m = _model(comm.rank + 50).to(dev)
        ddp = ss.SparseDDP(m, cc, reducer="dense", merge=merge, profile_warmup=1, profile_steps=2)
        assert torch.equal(_flat_params(m), _flat_params(ref))
        for step in range(5):
            x, y = (t.to(dev) for t in _batch(comm.rank, step))
            ref.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            want = cc.allreduce(_flat_grads(ref)) / P
            m.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            got = _flat_grads(m)
            assert got.device == dev
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (merge, step, float((got - want).abs().max()))
            assert _times_ok(ddp.last_stats), ddp.last_stats
        ddp.close()
    # every reducer (several groups), and delayed averaging: parameters bitwise identical across ranks
    for name, kw in [(n, {}) for n in names] + [("topka", {"delay": 1}), ("micro", {"delay": 1})]:
        m = _model(comm.rank).to(dev)
        ddp = ss.SparseDDP(m, cc, reducer=name, density=0.1, merge="buckets:0.002", **kw)
        _sgd_steps(ddp, m, comm.rank, dev, 6)
        ddp.flush()
        assert _times_ok(ddp.last_stats) and ddp.last_stats["groups"] > 1, (name, ddp.last_stats)
        out[f"{name}{kw}"] = _flat_params(m).cpu()
        ddp.close()
    # the default group (no comm given) with CUDA parameters
    m = _model(comm.rank).to(dev)
    ddp = ss.SparseDDP(m, reducer="topka", density=0.1)
    _sgd_steps(ddp, m, comm.rank, dev, 3)
    out["default comm"] = _flat_params(m).cpu()
    ddp.close()
    return out


def test_sparseddp_on_cuda():
    res = ss.run_local(_ddp_suite, 2, NAMES, backend="gloo", timeout=TIMEOUT)
    assert set(res[0]) == set(res[1])
    for key in res[0]:
        assert torch.equal(res[0][key], res[1][key]), f"{key}: rank 1's parameters differ from rank 0's"


# ---------------------------------------------------------------------- state dicts between devices
def _fresh(comm, name, device):
    m = _model(comm.rank).to(device)
    ddp = ss.SparseDDP(m, comm, reducer=name, density=0.1, merge="buckets:0.002")
    return m, ddp, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def _steps(m, ddp, opt, start, stop):
    dev = next(m.parameters()).device
    for step in range(start, stop):
        x, y = (t.to(dev) for t in _batch(ddp.comm.rank, step))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _saved(ddp, opt, map_location) -> dict:
    """The checkpoint as a file would hold it, read back onto ``map_location``."""
    buf = io.BytesIO()
    torch.save({"ddp": ddp.state_dict(), "opt": opt.state_dict()}, buf)
    return torch.load(io.BytesIO(buf.getvalue()), map_location=map_location, weights_only=False)


def _resume_across_devices(comm, names):
    cc = _cuda_comm(comm)
    dev = cc.device
    out = {}
    for name in names:
        m, ddp, opt = _fresh(cc, name, dev)  # straight: 6 steps on CUDA
        _steps(m, ddp, opt, 0, 6)
        straight = copy.deepcopy({"ddp": ddp.state_dict(), "opt": opt.state_dict()})
        ddp.close()
        m, ddp, opt = _fresh(cc, name, dev)  # 3 steps on CUDA, saved ...
        _steps(m, ddp, opt, 0, 3)
        ck = _saved(ddp, opt, "cpu")
        ddp.close()
        mc, dc, oc = _fresh(comm, name, "cpu")  # ... loaded on the CPU (which can go on from there) ...
        dc.load_state_dict(ck["ddp"])
        oc.load_state_dict(ck["opt"])
        assert all(p.device.type == "cpu" for p in mc.parameters())
        assert all(r.residual is None or r.residual.device.type == "cpu" for r in dc.reducers)
        back = _saved(dc, oc, dev)
        _steps(mc, dc, oc, 3, 4)
        dc.close()
        m, ddp, opt = _fresh(cc, name, dev)  # ... and back on CUDA: 3 more steps
        ddp.load_state_dict(back["ddp"])
        opt.load_state_dict(back["opt"])
        _steps(m, ddp, opt, 3, 6)
        _assert_same_state({"ddp": ddp.state_dict(), "opt": opt.state_dict()}, straight, f"{name} rank {comm.rank}")
        ddp.close()
        out[name] = "ok"
    return out


def test_state_dict_moves_between_cuda_and_cpu_and_resumes_bitwise():
    res = ss.run_local(_resume_across_devices, 2, NAMES, backend="gloo", timeout=TIMEOUT)
    assert all(r == {n: "ok" for n in NAMES} for r in res)


# ---------------------------------------------------------------------- after a backward pass here
def _backward_steps(comm):
    """A backward pass on the CPU and one on the GPU in the rank; the GPU gradient summed over the ranks."""
    w = torch.full((3,), float(comm.rank + 1), requires_grad=True)
    (w * w).sum().backward()
    cc = _cuda_comm(comm)
    v = torch.full((3,), float(comm.rank + 1), device=cc.device, requires_grad=True)
    (v * v).sum().backward()
    return float(w.grad.sum()), float(cc.allreduce(v.grad.clone()).sum().cpu())


def test_ranks_train_after_a_backward_pass_in_the_parent():
    """A backward pass on CUDA in this process starts autograd's device threads (and CUDA): a
    forked rank could run neither backward nor CUDA, so ``run_local`` spawns the ranks then."""
    from sparsync.launch import _pick_start_method

    v = torch.ones(4, device="cuda", requires_grad=True)
    (v * 2).sum().backward()
    assert _pick_start_method(None) == "spawn"
    res = ss.run_local(_backward_steps, 2, backend="gloo", timeout=TIMEOUT)
    assert res == [(6.0, 18.0), (12.0, 18.0)]
