"""SparseDDP(delay=1), delayed averaging: ``.grad`` after step t's backward holds exactly the
average that ``delay=0`` gives after step t-1's, the step in flight survives a checkpoint (bitwise
resume), and parameters stay identical on every rank (real gloo processes too)."""

import pytest
import torch

import sparsync as ss
from sparsync.commands.compare import parse_configs


class _Linear(torch.nn.Module):
    """``loss = sum(W x c)``: its gradient ``c x^T`` does not depend on the parameters, so two runs
    that apply different updates still feed the reducers the same gradients."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(7, 5)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x):
        return torch.cat([self.a(x[:, :7]), self.b(x[:, 7:])], 1)


def _grads(comm, delay, reducer, policy, set_to_none, steps=7):
    model = _Linear()
    pol = ss.GradientPolicy(momentum=0.9, masking=True) if policy else None
    ddp = ss.SparseDDP(model, comm, reducer=reducer, density=0.3, policy=pol, delay=delay)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(11 + comm.rank)
    seen = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x, c = torch.randn(4, 12, generator=gen), torch.randn(4, 8, generator=gen)
        (ddp(x) * c).sum().backward()
        seen.append(None if model.a.weight.grad is None else
                    torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        opt.step()
    flushed = ddp.flush()
    last = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone() if flushed else None
    assert not ddp.flush()  # nothing left in flight
    ddp.close()
    return seen, last


@pytest.mark.parametrize("reducer,policy", [("dense", False), ("micro", False), ("micro", True), ("topka", True)])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_delay_applies_the_previous_steps_average_bitwise(reducer, policy, set_to_none):
    P = 3
    now = ss.run_local(_grads, P, 0, reducer, policy, set_to_none)
    late = ss.run_local(_grads, P, 1, reducer, policy, set_to_none)
    for r in range(P):
        seen0, _ = now[r]
        seen1, last = late[r]
        assert seen1[0] is None  # first step: nothing to apply, optimizer.step() skips the parameters
        for t in range(1, len(seen1)):
            assert torch.equal(seen1[t], seen0[t - 1]), (r, t)
        assert torch.equal(last, seen0[-1])  # flush() applies the step still in flight
        assert all(torch.equal(a, b) for a, b in zip(seen1[1:], late[0][0][1:]))  # same bits on every rank


def _mlp(norm=False):
    mid = [torch.nn.BatchNorm1d(30)] if norm else []  # buffers: broadcast on the training thread each step
    return torch.nn.Sequential(torch.nn.Linear(10, 30), *mid, torch.nn.ReLU(), torch.nn.Linear(30, 4))


def _train(comm, delay, steps, resume_from=None, save_at=None, norm=False):
    model = _mlp(norm)
    init = torch.Generator().manual_seed(100 + comm.rank)  # different on every rank: rank 0's is broadcast
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.3)
    pol = ss.GradientPolicy(momentum=0.9, masking=False, warmup_steps=4, warmup_start=0.3)
    ddp = ss.SparseDDP(model, comm, reducer="micro", density=0.05, policy=pol, delay=delay)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if resume_from is not None:
        state = resume_from[comm.rank]
        ddp.load_state_dict(state["ddp"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    saved = None
    for t in range(start, steps):
        gen = torch.Generator().manual_seed(1000 * comm.rank + t)
        x, y = torch.randn(8, 10, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if save_at is not None and t + 1 == save_at:
            saved = {"ddp": ddp.state_dict(), "opt": opt.state_dict(), "step": save_at}
    ddp.close()
    return torch.cat([t.detach().reshape(-1).float() for t in model.state_dict().values()]), saved


def test_delay_resumes_bitwise_with_the_step_in_flight():
    P, T = 3, 8
    straight = ss.run_local(_train, P, 1, T)
    first = ss.run_local(_train, P, 1, 4, save_at=4)
    assert first[0][1]["ddp"]["_extra_state"]["inflight"] is not None
    resumed = ss.run_local(_train, P, 1, T, [s for _, s in first])
    now = ss.run_local(_train, P, 0, T)
    for r in range(P):
        assert torch.equal(resumed[r][0], straight[r][0]), r
        assert torch.equal(straight[r][0], straight[0][0])  # identical on every rank
    assert not torch.equal(now[0][0], straight[0][0])  # delay=1 is a different trajectory


@pytest.mark.gloo
def test_delay_keeps_ranks_identical_gloo():
    res = ss.run_local(_train, 3, 1, 6, None, None, True, backend="gloo", timeout=120)
    assert all(torch.equal(flat, res[0][0]) for flat, _ in res)


def test_delay_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="delay must be 0"):
        ss.run_local(lambda comm: ss.SparseDDP(_mlp(), comm, reducer="micro", delay=2), 1)
    with pytest.raises(ValueError, match="delay=1 needs a merge plan that is final"):
        ss.run_local(lambda comm: ss.SparseDDP(_mlp(), comm, reducer="micro", merge="mgwfbp", delay=1), 1)
    saved = ss.run_local(_train, 1, 1, 2, save_at=2)[0][1]

    def load_into_undelayed(comm):
        ddp = ss.SparseDDP(_mlp(), comm, reducer="micro", density=0.05, delay=0,
                           policy=ss.GradientPolicy(momentum=0.9, masking=False, warmup_steps=4, warmup_start=0.3))
        ddp.load_state_dict(saved["ddp"])

    with pytest.raises(ValueError, match="saved with delay=1"):
        ss.run_local(load_into_undelayed, 1)


def test_compare_config_routes_delay_to_sparseddp():
    (c,) = parse_configs("micro:0.02,momentum=0.9,delay=1,cap_factor=2", 0.01, "single")
    assert c["ddp"] == {"delay": 1} and c["options"] == {"cap_factor": 2} and c["convergence"] == {"momentum": 0.9}
