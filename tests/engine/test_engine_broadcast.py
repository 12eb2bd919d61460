"""SparseDDP's construction broadcast: ranks that start from *different* parameters and buffers end
with rank 0's, and a rank-local buffer change is overwritten by rank 0's at every forward (as torch
DDP's ``broadcast_buffers``), so a missing broadcast is caught."""

import torch
from torch import nn

import sparsync as ss


class _WithBuffer(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("shift", torch.zeros(4))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.lin.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.shift.copy_(torch.randn(4, generator=g))

    def forward(self, x):
        return self.lin(x + self.shift)


def _ddp_from_different_inits(comm):
    m = _WithBuffer(seed=10 + comm.rank)  # every rank starts from different parameters and buffers
    ddp = ss.SparseDDP(m, comm, reducer="dense")
    after_init = [t.detach().clone() for t in list(m.parameters()) + list(m.buffers())]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + comm.rank)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        m.shift.add_(float(comm.rank))  # a rank-local buffer change: forward re-broadcasts rank 0's
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    final = [t.detach().clone() for t in list(m.parameters()) + list(m.buffers())]
    return after_init, final


def test_sparseddp_broadcasts_rank0_state_from_different_inits():
    res = ss.run_local(_ddp_from_different_inits, 3, backend="thread", timeout=60)
    rank0 = _WithBuffer(seed=10)
    expect = [t.detach() for t in list(rank0.parameters()) + list(rank0.buffers())]
    for after_init, final in res:
        assert all(torch.equal(a, e) for a, e in zip(after_init, expect))
        assert all(torch.equal(a, b) for a, b in zip(final, res[0][1]))
