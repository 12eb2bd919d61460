"""The torch DDP comm hook never deadlocks beside DDP's own collectives (``find_unused_parameters=True``),
and per-rank state survives a checkpoint that one rank writes (the gathered form); loading another
rank's state refuses. Real gloo processes; every run_local has a short timeout, so a regression fails
(gloo's timeout raises in the ranks) instead of hanging."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparsync as ss

pytestmark = pytest.mark.gloo


class Net(nn.Module):
    """Two used layers and one that forward never touches (what find_unused_parameters is for)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 64)
        self.b = nn.Linear(64, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def _steps(model, opt, rank, start, stop):
    for s in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + s)
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _ddp(seed=0, asynchronous=True, reducer="topka"):
    torch.manual_seed(seed)
    net = Net()
    # the README's registration, with the flag the HF Trainer turns on for a PreTrainedModel
    model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True, bucket_cap_mb=0.002)
    hook = ss.ddp_hook(reducer, density=0.1, module=model, asynchronous=asynchronous)
    model.register_comm_hook(None, hook)
    return model, hook, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _find_unused(comm):
    a_model, a_hook, a_opt = _ddp()
    _steps(a_model, a_opt, comm.rank, 0, 6)
    s_model, _, s_opt = _ddp(asynchronous=False)
    _steps(s_model, s_opt, comm.rank, 0, 6)
    own = a_hook.comm.group
    return {"async": _flat(a_model.module), "sync": _flat(s_model.module),
            "own_group": own is not None and own is not dist.group.WORLD,
            "unused": _flat(a_model.module.unused), "buckets": len(a_hook.reducers)}


def test_find_unused_parameters_trains_without_deadlock():
    res = ss.run_local(_find_unused, 2, backend="gloo", timeout=40)
    torch.manual_seed(0)
    init = Net()
    for r in range(2):
        assert res[r]["own_group"], "the hook reduced on DDP's group"
        assert torch.equal(res[r]["async"], res[r]["sync"]), f"rank {r}: async hook differs from the synchronous one"
        assert torch.equal(res[r]["unused"], _flat(init.unused)), "an unused parameter moved"
    assert res[0]["buckets"] > 1
    assert torch.equal(res[0]["async"], res[1]["async"]), "ranks diverged"
    assert not torch.equal(res[0]["async"], _flat(init)), "training did not move the parameters"


def _explicit_group(comm):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net(), find_unused_parameters=True)
    group = dist.new_group()
    hook = ss.ddp_hook("topka", density=0.1, module=model)
    model.register_comm_hook(group, hook)
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.05), comm.rank, 0, 2)
    return hook.comm.group is group


def test_explicit_group_is_used_as_given():
    assert ss.run_local(_explicit_group, 2, backend="gloo", timeout=40) == [True, True]


# ---------------------------------------------------------------------- per-rank state
def _single_writer_resume(comm, path):
    rank = comm.rank
    model, hook, opt = _ddp()
    _steps(model, opt, rank, 0, 8)
    straight = _flat(model.module)

    model, hook, opt = _ddp()
    _steps(model, opt, rank, 0, 4)
    mine = hook.state_dict()
    gathered = hook.gathered_state_dict()
    if rank == 0:  # one writer, as Lightning / accelerate / the HF Trainer do
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": gathered}, path)
    dist.barrier()
    blob = torch.load(path, weights_only=True)

    model2, hook2, opt2 = _ddp(seed=7)
    model2.module.load_state_dict(blob["model"])
    opt2.load_state_dict(blob["opt"])
    hook2.load_state_dict(blob["hook"])
    _steps(model2, opt2, rank, 4, 8)

    refused = warned = None
    other = blob["hook"]["states"][1 - rank]
    try:
        ss.ddp_hook("topka", density=0.1, module=model2).load_state_dict(other)
    except ValueError as e:
        refused = str(e)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ss.ddp_hook("topka", density=0.1, module=model2).load_state_dict({**other, "world_size": 4})
        warned = [str(x.message) for x in w]
    return {"straight": straight, "resumed": _flat(model2.module), "rank": mine["rank"],
            "world_size": mine["world_size"], "refused": refused, "warned": warned,
            "own_residual": mine["per_param"], "gathered_mine": gathered["states"][rank]["per_param"]}


def test_hook_state_single_writer_resume_is_bitwise_and_other_rank_refused():
    with tempfile.TemporaryDirectory() as d:
        res = ss.run_local(_single_writer_resume, 2, os.path.join(d, "ckpt.pt"), backend="gloo", timeout=60)
    for r in range(2):
        out = res[r]
        assert (out["rank"], out["world_size"]) == (r, 2)
        assert torch.equal(out["straight"], out["resumed"]), f"rank {r}: resume from rank 0's file is not bitwise"
        assert out["refused"] is not None and "saved by rank" in out["refused"] and "\n" not in out["refused"]
        assert any("rank" in m and "of 4" in m for m in out["warned"]), out["warned"]
        assert out["own_residual"].keys() == out["gathered_mine"].keys()
        for k, v in out["own_residual"].items():
            assert torch.equal(v, out["gathered_mine"][k])
    # the residuals differ between ranks: loading rank 0's everywhere would have been wrong
    a, b = res[0]["own_residual"], res[1]["own_residual"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(res[0]["resumed"], res[1]["resumed"])


def _sparseddp_state(comm):
    def make(seed):
        torch.manual_seed(seed)
        return ss.SparseDDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), comm,
                            reducer="topka", density=0.1)

    def train(ddp, opt, start, stop):
        _steps(ddp, opt, comm.rank, start, stop)

    ddp = make(0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    train(ddp, opt, 0, 6)
    straight = _flat(ddp.module)

    ddp = make(0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    train(ddp, opt, 0, 3)
    gathered = ddp.gathered_state_dict()
    own = ddp.sparsync_state_dict()
    rank0 = gathered["_extra_state"]["states"][0]
    ddp2 = make(5)
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.05)
    ddp2.load_state_dict(gathered)
    opt2.load_state_dict(opt.state_dict())
    train(ddp2, opt2, 3, 6)
    refused, ddp3 = None, make(5)  # construction is collective: every rank
    if comm.rank == 1:
        try:
            ddp3.load_sparsync_state_dict(rank0)
        except ValueError as e:
            refused = str(e)
    return {"straight": straight, "resumed": _flat(ddp2.module), "stamp": (own["rank"], own["world_size"]),
            "refused": refused}


def test_sparseddp_gathered_state_resumes_bitwise_and_other_rank_refused():
    res = ss.run_local(_sparseddp_state, 2, backend="gloo", timeout=60)
    for r in range(2):
        assert res[r]["stamp"] == (r, 2)
        assert torch.equal(res[r]["straight"], res[r]["resumed"]), f"rank {r}: gathered resume is not bitwise"
    assert "saved by rank 0" in res[1]["refused"]


def _reducer_state(comm):
    from sparsync import rankstate

    r = ss.make_reducer("topka", comm, density=0.1)
    r.reduce(torch.randn(200, generator=torch.Generator().manual_seed(comm.rank)))
    states = rankstate.gather(r.state_dict(), comm)["states"]
    fresh = ss.make_reducer("topka", comm, density=0.1)
    fresh.load_state_dict(states[comm.rank])
    try:
        ss.make_reducer("topka", comm, density=0.1).load_state_dict(states[1 - comm.rank])
    except ValueError as e:
        return torch.equal(fresh.residual.cpu(), r.residual.cpu()), str(e)
    return None


def test_bare_reducer_state_is_per_rank():
    for same, msg in ss.run_local(_reducer_state, 2, backend="thread", timeout=30):
        assert same and "saved by rank" in msg
