"""Real processes (gloo over loopback), world sizes 1..8: every SparDL variant and baseline in one run.

Checks bitwise-identical outputs on all ranks and the conservation identity for conserving reducers;
fixed-capacity SparDL messages must pay no size header on the real backend either.
"""

import pytest
import torch

import sparsync as ss
from test_spardl_reducer import _run_configs


def _configs(P):
    cfg = [("spardl", {}), ("spardl", {"residuals": "partial"}), ("topkdsa", {}),
           ("oktopk", {"recompute_every": 2, "balance_every": 2})]
    for d in range(2, P + 1):
        if P % d == 0 and d < P or (d == P and P in (2, 3)):
            cfg.append(("spardl", {"teams": d}))  # R-SAG for powers of two, else B-SAG
            if d & (d - 1) == 0 and d > 2:
                cfg.append(("spardl", {"teams": d, "team_allgather": "b"}))
    if P & (P - 1) == 0:
        cfg.append(("gtopk", {}))
    return cfg


def _gloo_body(comm, cfg):
    res = _run_configs(comm, cfg, 1201, 2, density=0.03)
    return [(outs, errs, cons, sum(l["header_bytes"] for l in led)) for outs, errs, _, led, cons in res]


@pytest.mark.gloo
@pytest.mark.parametrize("P", list(range(1, 9)))
def test_gloo_all_reducers(P):
    cfg = _configs(P)
    res = ss.run_local(_gloo_body, P, cfg, backend="gloo", timeout=60)
    for c, (name, opts) in enumerate(cfg):
        for s in range(2):
            assert all(torch.equal(res[w][c][0][s], res[0][c][0][s]) for w in range(P)), (name, opts)
        if res[0][c][2]:
            assert max(res[w][c][1][s] for w in range(P) for s in range(2)) < 1e-12, (name, opts)
        if name == "spardl":
            assert res[0][c][3] == 0  # fixed capacity: no header on the wire
