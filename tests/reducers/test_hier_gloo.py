"""The hierarchical exchange on real gloo ranks: sub-groups from ``Comm.split`` (``dist.new_group``), exact
with a dense outer reducer and bitwise identical on every rank for two layouts, and usable through SparseDDP
(``reducer="hier"``) and the torch DDP comm hook (``ss.ddp_hook("hier", ...)``) with ranks kept identical."""

import torch
from torch import nn

from engine.test_engine_ddp import _sgd_steps
from engine.test_engine_ddp import _flat_params as _params

import sparsync as ss
from sparsync.reducers.registry import make_reducer


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 4))  # _batch's 12 inputs, 4 outputs


def _train(net, params, rank, steps=4):
    _sgd_steps(net, torch.optim.SGD(params, lr=0.1), rank, steps)


def _suite(comm):
    out = {}
    n = 1001
    for sites in ("2x2", [[0, 2], [1, 3]]):
        for outer in ("dense", "micro"):
            r = make_reducer("hier", comm, density=0.05, outer=outer, sites=sites)
            rows = []
            for t in range(3):
                g = torch.randn(n, generator=torch.Generator().manual_seed(17 * comm.rank + t))
                rows.append((g, r.reduce(g).clone(), dict(r.stats)))
            out[(str(sites), outer)] = rows
    # SparseDDP: sites from the environment (what the emulated cluster's placement sets)
    import os

    os.environ["SPARSYNC_SITES"] = "0,1;2,3"
    m = _model()
    ddp = ss.SparseDDP(m, comm, reducer="hier", density=0.1, reducer_options={"outer": "micro"})
    _train(ddp, m.parameters(), comm.rank)
    out["sparseddp"] = _params(m)
    out["sparseddp_stats"] = dict(ddp.last_stats)
    ddp.close()
    # torch DDP + the hook
    m2 = nn.parallel.DistributedDataParallel(_model())
    m2.register_comm_hook(None, ss.ddp_hook("hier", density=0.1, module=m2, outer="topka", sites="2x2"))
    _train(m2, m2.parameters(), comm.rank)
    out["hook"] = _params(m2.module)
    return out


def test_hier_on_gloo():
    P = 4
    res = ss.run_local(_suite, P, backend="gloo", timeout=240)
    for key in res[0]:
        if not isinstance(key, tuple):
            continue
        for t in range(3):
            got = res[0][key][t][1]
            for r in range(P):
                assert torch.equal(res[r][key][t][1], got), (key, t, r)
            if key[1] == "dense":
                ref = sum(res[r][key][t][0].double() for r in range(P))
                assert torch.allclose(got.double(), ref, rtol=0, atol=4e-5), (key, (got.double() - ref).abs().max())
            st = res[0][key][t][2]
            assert st["intra_bytes"] == 2 * 1 * 501 * 4 and st["sites"] == "2x2"
    for k in ("sparseddp", "hook"):
        for r in range(P):
            assert torch.equal(res[r][k], res[0][k]), (k, r)
    assert not torch.equal(res[0]["sparseddp"], _params(_model()))  # it trained
