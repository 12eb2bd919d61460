"""The engine's cheap paths for a sparse result, checked against
the plain paths they replace:

* an :class:`~sparsync.reducers.base.IndexedSum` written into the ``.grad`` buffer by clearing only
  last step's non-zeros must give the same ``.grad`` bits as the dense write-back, whatever the user
  did to ``.grad`` in between (``zero_grad`` either way, in-place edits);
* momentum correction read from the per-parameter gradients (``before_reduce_parts``) must give the
  same velocity bits as the flat-buffer path.
"""

import pytest
import torch

import sparsync as ss
from sparsync.reducers.base import IndexedSum


def _model():
    return torch.nn.Sequential(torch.nn.Linear(10, 40), torch.nn.ReLU(), torch.nn.Linear(40, 33),
                               torch.nn.ReLU(), torch.nn.Linear(33, 4))


def _grads_per_step(comm, indexed, set_to_none, edit, policy, steps=6):
    model = _model()
    init = torch.Generator().manual_seed(comm.rank)  # per rank (threads share the global RNG);
    with torch.no_grad():  # different on every rank: SparseDDP broadcasts rank 0's
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.3)
    pol = (ss.GradientPolicy if indexed else _PartsOff)(momentum=0.9, masking=False) if policy else None
    ddp = ss.SparseDDP(model, comm, reducer="micro", density=0.05, policy=pol)
    for r in ddp.reducers:
        r.indexed_output = indexed  # the reference: the dense result and the full write-back
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7 + comm.rank)
    seen = []
    for t in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = torch.randn(8, 10, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        seen.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        if edit and t % 2 == 1:  # a user's in-place edit of .grad (e.g. weight decay by hand)
            for p in model.parameters():
                p.grad.add_(p.detach(), alpha=1e-3)
        opt.step()
    ddp.close()
    return seen


class _PartsOff(ss.GradientPolicy):
    reads_parts = False  # the reference: gradients gathered into the flat buffer first


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("edit", [False, True])
@pytest.mark.parametrize("policy", [False, True])
def test_indexed_writeback_equals_dense_writeback(set_to_none, edit, policy):
    P = 3
    fast = ss.run_local(_grads_per_step, P, True, set_to_none, edit, policy)
    ref = ss.run_local(_grads_per_step, P, False, set_to_none, edit, policy)
    for r in range(P):
        for t, (a, b) in enumerate(zip(fast[r], ref[r])):
            assert torch.equal(a, b), (r, t)
        assert all(torch.equal(a, b) for a, b in zip(fast[r], fast[0]))  # and across ranks


def test_writeback_clears_only_last_nonzeros_when_untouched():
    from sparsync.schedule.buffers import GradBuffers

    p = torch.nn.Parameter(torch.zeros(10))
    buf = GradBuffers([p])
    buf.set_groups([[0]])
    buf.write_indexed(0, IndexedSum(torch.tensor([1, 4]), torch.tensor([2.0, 4.0]), 10), 2)
    assert p.grad.tolist() == [0, 1, 0, 0, 2, 0, 0, 0, 0, 0]
    buf.write_indexed(0, IndexedSum(torch.tensor([4, 9]), torch.tensor([6.0, 8.0]), 10), 2)
    assert p.grad.tolist() == [0, 0, 0, 0, 3, 0, 0, 0, 0, 4]
    p.grad[7] = 5.0  # written by someone else: the next write must not trust its bookkeeping
    buf.write_indexed(0, IndexedSum(torch.tensor([0]), torch.tensor([2.0]), 10), 2)
    assert p.grad.tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]


def test_velocity_from_parts_equals_velocity_from_flat_gradient():
    gen = torch.Generator().manual_seed(3)
    numels = [7, 1, 130, 33, 1]  # odd sizes and offsets: vectorised kernels' tails in other places
    for clip in (None, 0.5):
        a = ss.GradientPolicy(momentum=0.9, masking=False, clip=clip)
        b = ss.GradientPolicy(momentum=0.9, masking=False, clip=clip)
        r = ss.make_reducer("topka", ss.threadcomm.ThreadWorld(1).comms()[0], density=0.1)
        for step in range(4):
            parts = [torch.randn(n, generator=gen) for n in numels]
            if step == 2:
                parts[1] = None  # an unused parameter contributes zero
            flat = torch.cat([torch.zeros(n) if g is None else g for g, n in zip(parts, numels)])
            ua = a.before_reduce(0, flat.clone(), r).clone()
            ub = b.before_reduce_parts(0, parts, numels, flat, r).clone()
            if clip is None:
                assert torch.equal(ua, ub), step
            else:  # the norm is summed per part: the same up to the rounding of that sum
                torch.testing.assert_close(ua, ub, rtol=1e-5, atol=1e-6)
