"""SparseDDP with the dense reducer reducing the ``.grad`` buffer itself (the engine donates its own buffers,
``reduce(..., donate=True)``; ``reducer_options={"inplace": True}`` asks for it on every call): the write-back
then divides the reduced buffer by P in place, and ``.grad`` must be the average over ranks - the same bits
as the copying path, equal to a dense reference and to torch DDP."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparsync as ss
from sparsync.torchcomm import TorchComm

MERGES = ["single", "wfbp", "buckets:0.002"]


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)


def _grads(m):
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def _mean_grad(model, P, step):
    """The dense reference: the average over ranks of every rank's local gradient (computed here)."""
    total = None
    for r in range(P):
        ref = copy.deepcopy(model)
        x, y = _batch(r, step)
        nn.functional.mse_loss(ref(x), y).backward()
        g = _grads(ref)
        total = g if total is None else total + g
    return total / P


def _inplace_vs_copy(comm, merge, set_to_none, as_view):
    out = []
    models = []
    first = _model(comm.rank + 7)  # rank-dependent: broadcast from rank 0
    for inplace in (True, False):
        m = copy.deepcopy(first)  # (thread ranks share torch's global RNG: one init, copied)
        ddp = ss.SparseDDP(m, comm, reducer="dense", merge=merge, reducer_options={"inplace": inplace},
                           gradient_as_bucket_view=as_view)
        models.append((m, ddp, torch.optim.SGD(m.parameters(), lr=0.05)))
    for step in range(3):
        want = _mean_grad(models[0][0], comm.world_size, step)
        got = []
        for m, ddp, opt in models:
            opt.zero_grad(set_to_none=set_to_none)
            x, y = _batch(comm.rank, step)
            nn.functional.mse_loss(ddp(x), y).backward()
            got.append(_grads(m))
            opt.step()
        inplace, copying = got
        assert torch.equal(inplace, copying), f"step {step}: in-place differs from the copying dense path"
        assert torch.allclose(inplace, want, rtol=1e-5, atol=1e-7), (step, (inplace - want).abs().max())
        out.append(inplace)
    for _, ddp, _ in models:
        ddp.close()
    return out


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("set_to_none,as_view", [(False, True), (True, True), (True, False)],
                         ids=["views", "fresh-grads", "no-bucket-view"])
def test_inplace_dense_grad_is_the_average(merge, set_to_none, as_view):
    res = ss.run_local(_inplace_vs_copy, 3, merge, set_to_none, as_view, backend="thread", timeout=60)
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(res[0], r))


def _donated_vs_copying(comm):
    torch.manual_seed(3)  # gloo ranks are processes: each its own generator, the same model
    m = nn.Sequential(nn.Linear(1024, 1100), nn.Tanh(), nn.Linear(1100, 4))  # > 1 Mi values: in pieces
    ref = copy.deepcopy(m)
    ddp = ss.SparseDDP(m, comm, reducer="dense")
    # the reference on a group of its own: its collectives (main thread) and SparseDDP's (its
    # communication thread) never share one gloo group's issue order
    copying = ss.make_reducer("dense", TorchComm(dist.new_group()), nonfinite="ignore")
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + comm.rank)
        x = torch.randn(8, 1024, generator=g)
        ref.zero_grad(set_to_none=True)
        ref(x).square().mean().backward()
        want = torch.div(copying.reduce(_grads(ref)), comm.world_size)  # copy, then all-reduce the copy
        m.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        assert torch.equal(_grads(m), want), f"step {step}: the donated buffer's average differs"
    donated_pool = ddp.reducers[0].__dict__.get("_output_pool")
    ddp.close()
    return not donated_pool, bool(copying.__dict__.get("_output_pool"))


def test_sparseddp_donates_its_buffer_to_dense_same_bits_no_copy():
    # a real gloo group, where the copying path all-reduces in pieces posted as they are copied: the
    # donated buffer is reduced in the same pieces - the same bits - and no output buffer is ever made
    for never_copied, reference_copied in ss.run_local(_donated_vs_copying, 2, backend="gloo", timeout=120):
        assert never_copied and reference_copied


def _against_torch_ddp(comm):
    ref = nn.parallel.DistributedDataParallel(_model(comm.rank + 7))
    m = _model(comm.rank + 7)
    ddp = ss.SparseDDP(m, comm, reducer="dense", merge="wfbp", reducer_options={"inplace": True})
    worst = 0.0
    for step in range(3):
        x, y = _batch(comm.rank, step)
        for model in (ref, ddp):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        a, b = _grads(m), _grads(ref.module)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (step, (a - b).abs().max())
        worst = max(worst, float((a - b).abs().max()))
    ddp.close()
    return worst


@pytest.mark.gloo
def test_inplace_dense_equals_torch_ddp_gloo():
    assert max(ss.run_local(_against_torch_ddp, 2, backend="gloo", timeout=120)) < 1e-6


def _auto_dense_in_the_input_buffer(comm):
    # auto with a sparse candidate (indexed output) gathers fresh gradients into the input-only buffer;
    # running dense, it reduces that buffer in place: the write-back must make it the .grad buffer (a
    # swap of the two buffers' roles), not divide it into the other one - and give dense's bits
    m = nn.Sequential(nn.Linear(64, 400), nn.Tanh(), nn.Linear(400, 4))
    torch.manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.2 * torch.randn(p.shape))
    ref = copy.deepcopy(m)
    fast = {"flat": (1e-6, 1e-12)}  # a declared fast link: dense is chosen and kept
    ddp = ss.SparseDDP(m, comm, reducer="auto", reducer_options={"candidates": "dense,micro:0.05", "link": fast})
    alone = ss.SparseDDP(ref, comm, reducer="dense")
    auto = ddp.reducers[0]
    results, swapped = [], []
    real = auto.reduce

    def reduce(x, **kw):
        out = real(x, **kw)
        results.append(out.untyped_storage().data_ptr())
        return out

    auto.reduce = reduce
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + comm.rank)
        x = torch.randn(8, 64, generator=g)
        for model, wrapped in ((m, ddp), (ref, alone)):
            model.zero_grad(set_to_none=True)
            wrapped(x).square().mean().backward()
        assert torch.equal(_grads(m), _grads(ref)), f"step {step}: auto running dense differs from dense"
        swapped.append(m[0].weight.grad.untyped_storage().data_ptr() == results[-1])  # where the sum was made
    choice = auto.choice
    ddp.close()
    alone.close()
    return choice, swapped


def test_auto_running_dense_swaps_its_input_buffer_into_grad():
    for choice, swapped in ss.run_local(_auto_dense_in_the_input_buffer, 2, backend="thread"):
        assert choice == "dense" and all(swapped), (choice, swapped)
