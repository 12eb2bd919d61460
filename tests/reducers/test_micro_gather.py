"""``micro``'s ``gather`` option: the direct all-gather (``comm.exchange`` to every peer) gives
bitwise the same outputs, residuals and ledger as gloo-style ring ``comm.allgather``."""

import pytest
import torch

import sparsync as ss


def test_direct_and_ring_gather_agree_bitwise_and_in_the_ledger():
    def fn(comm):
        n, res = 4099, {}
        for how in ("direct", "ring"):
            r = ss.make_reducer("micro", comm, density=0.03, gather=how)
            outs, costs = [], []
            for t in range(6):
                g = torch.Generator().manual_seed(10 * comm.rank + t)
                outs.append(r.reduce(torch.randn(n, generator=g) * (1 + t)))
                costs.append({k: r.stats[k] for k in ("rounds", "bytes_sent", "bytes_received", "messages")})
            res[how] = (outs, costs, r.residual.clone())
        d, g = res["direct"], res["ring"]
        same = all(torch.equal(a, b) for a, b in zip(d[0], g[0])) and torch.equal(d[2], g[2])
        return same, d[1] == g[1], [float(o.double().sum()) for o in d[0]]

    for P in (1, 2, 5):
        out = ss.run_local(fn, P)
        assert all(o[0] and o[1] for o in out), P
        assert all(o[2] == out[0][2] for o in out), P


def test_bad_gather_option():
    def fn(comm):
        with pytest.raises(ValueError, match="gather"):
            ss.make_reducer("micro", comm, gather="tree")
        return True

    assert all(ss.run_local(fn, 2))
