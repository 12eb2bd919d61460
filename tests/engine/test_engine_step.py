"""The engine's step: gradients live in per-group flat buffers (no copy when ``.grad`` is
already the view, one copy otherwise, no fresh allocation), the wait is fully accounted for, and the
convergence-policy protocol (``/work`` iface: density per step, before/after_reduce, state) is called
where it should be (thread ranks)."""

import pytest
import torch
from torch import nn

import sparsync as ss
from sparsync.convergence import ConvergencePolicy


def _mlp(seed):
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _step(ddp, m, comm, s, set_to_none=True):
    m.zero_grad(set_to_none=set_to_none)
    x, y = _data(comm.rank, s)
    nn.functional.mse_loss(ddp(x), y).backward()


def test_grads_are_views_into_flat_buffers():
    def fn(comm):
        m = _mlp(0)
        ddp = ss.SparseDDP(m, comm, reducer="dense", merge="buckets:0.0005")
        numel = sum(p.numel() for p in m.parameters())
        _step(ddp, m, comm, 0)
        first = ddp.last_stats["copied_bytes"]
        eng = ddp.engine
        flats = [(f.data_ptr(), f.data_ptr() + f.numel() * 4) for f in eng.buffers.flat]
        ptrs = [p.grad.data_ptr() for p in m.parameters()]
        assert all(any(lo <= q < hi for lo, hi in flats) for q in ptrs), "a .grad is not a view of a flat buffer"
        _step(ddp, m, comm, 1, set_to_none=False)  # autograd accumulates into the views: nothing to copy
        no_copy = ddp.last_stats["copied_bytes"]
        assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
        _step(ddp, m, comm, 2, set_to_none=True)   # fresh autograd tensors: copied once, same buffers
        assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
        ddp.close()
        return first, no_copy, ddp.last_stats["copied_bytes"], numel, len(eng.groups)

    for first, no_copy, again, numel, groups in ss.run_local(fn, 2, backend="thread", timeout=30):
        assert first == again == 4 * numel and no_copy == 0 and groups > 1


def test_gradients_equal_reference_with_views_and_no_sync():
    """Averages are exact whatever zero_grad does (views accumulated in place, or fresh tensors)."""
    P = 3

    def ref(step):
        gs = []
        for r in range(P):
            m = _mlp(0)
            x, y = _data(r, step)
            nn.functional.mse_loss(m(x), y).backward()
            gs.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
        return torch.stack(gs).sum(0) / P

    def fn(comm):
        m = _mlp(0)
        ddp = ss.SparseDDP(m, comm, reducer="dense", merge="wfbp")
        out = []
        for s, stn in ((0, True), (1, False), (2, True)):
            _step(ddp, m, comm, s, set_to_none=stn)
            out.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]).clone())
        ddp.close()
        return out

    for got in ss.run_local(fn, P, backend="thread", timeout=30):
        for s, g in enumerate(got):
            assert torch.allclose(g, ref(s), atol=1e-7), s


@pytest.mark.parametrize("reducer", ["dense", "micro"])
def test_wait_breakdown_adds_up(reducer):
    def fn(comm):
        m = _mlp(1)
        ddp = ss.SparseDDP(m, comm, reducer=reducer, density=0.2, merge="wfbp")
        rows = []
        for s in range(3):
            _step(ddp, m, comm, s)
            rows.append(dict(ddp.last_stats))
        ddp.close()
        return rows

    parts = ("copy", "check", "policy", "select", "comm", "reducer_other", "idle")
    for rows in ss.run_local(fn, 2, backend="thread", timeout=30):
        for st in rows:
            assert all(st[f"wait_{k}_s"] >= 0 for k in parts)
            assert abs(sum(st[f"wait_{k}_s"] for k in parts) - st["wait_s"]) < 1e-6, st
            assert st["copy_s"] >= st["writeback_s"] >= 0 and st["cpu_wait_s"] >= 0
            assert st["reduce_s"] == pytest.approx(st["select_s"] + st["comm_s"] + st["reducer_other_s"])


class _HalfPolicy(ConvergencePolicy):
    """A tiny policy: halves the gradient, full density for two steps, counts its calls (its state)."""

    def __init__(self):
        self.before = 0
        self.after = []

    def density(self, step, target):
        return 1.0 if step < 2 else target

    def before_reduce(self, key, grad, reducer):
        assert grad.dim() == 1 and grad.dtype == torch.float32
        self.before += 1
        return grad.mul_(0.5)

    def after_reduce(self, key, reducer):
        self.after.append((key, reducer.stats["target_density"]))

    def state_dict(self):
        return {"before": self.before, "after": list(self.after)}

    def load_state_dict(self, d):
        self.before, self.after = d["before"], list(d["after"])


def test_policy_protocol_call_sites_and_state():
    P = 2

    def fn(comm):
        m = _mlp(2)
        pol = _HalfPolicy()
        ddp = ss.SparseDDP(m, comm, reducer="dense", merge="wfbp", policy=pol)
        _step(ddp, m, comm, 0)
        g = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).clone()
        ddp.close()
        m2 = _mlp(2)
        pol2 = _HalfPolicy()
        ddp2 = ss.SparseDDP(m2, comm, reducer="topka", density=0.25, merge="wfbp", policy=pol2)
        for s in range(4):
            _step(ddp2, m2, comm, s)
        state = ddp2.sparsync_state_dict()
        ddp3 = ss.SparseDDP(_mlp(3), comm, reducer="topka", density=0.25, merge="wfbp", policy=_HalfPolicy())
        ddp3.load_state_dict(ddp2.state_dict())
        with pytest.raises(ValueError, match="policy"):
            ss.SparseDDP(_mlp(3), comm, reducer="topka", density=0.25, merge="wfbp").load_sparsync_state_dict(state)
        with pytest.raises(TypeError, match="before_reduce"):
            ss.SparseDDP(_mlp(3), comm, policy=object())
        groups = len(ddp2.engine.groups)
        for d in (ddp2, ddp3):
            d.close()
        return g, pol2.before, pol2.after, groups, state["policy"], ddp3.policy.state_dict()

    ref = 0
    for r in range(P):
        m = _mlp(2)
        x, y = _data(r, 0)
        nn.functional.mse_loss(m(x), y).backward()
        ref = ref + torch.cat([p.grad.reshape(-1) for p in m.parameters()]) / P
    for g, before, after, groups, saved, loaded in ss.run_local(fn, P, backend="thread", timeout=30):
        assert torch.allclose(g, 0.5 * ref, atol=1e-7)  # before_reduce's tensor is what was reduced
        assert before == 4 * groups and len(after) == 4 * groups
        assert [d for _, d in after] == [1.0] * (2 * groups) + [0.25] * (2 * groups)  # density per step
        assert [k for k, _ in after[:groups]] == list(range(groups))  # keys: group indices in plan order
        assert saved == loaded == {"before": before, "after": after}
