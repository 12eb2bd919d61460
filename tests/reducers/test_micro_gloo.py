"""micro / hard_threshold / cltk / topka on real gloo processes, world sizes 1..8 (one run per size)."""

import pytest
import torch

import sparsync as ss

NAMES = ["micro", "hard_threshold", "cltk", "topka", "micro_ring_fp16", "micro_gather_fp16"]
OPTS = {"micro": {}, "hard_threshold": {"threshold": 2.0}, "cltk": {}, "topka": {},
        # gloo's ring all-gather of the 16-bit index offsets (as bytes) and half-precision owner sums
        "micro_ring_fp16": {"gather": "ring", "value_dtype": "fp16", "values": "owner"},
        # every rank's half-precision contributions all-gathered directly, summed by every rank
        "micro_gather_fp16": {"value_dtype": "fp16", "values": "gather"}}
REDUCER = {"micro_ring_fp16": "micro", "micro_gather_fp16": "micro"}  # row label -> reducer, where they differ


def _body(comm, n, steps):
    out = {}
    for name in NAMES:
        r = ss.make_reducer(REDUCER.get(name, name), comm, density=0.05, **OPTS[name])
        recs = []
        for t in range(steps):
            g = torch.randn(n, generator=torch.Generator().manual_seed(1000 * comm.rank + t)) * (1 + t)
            before = torch.zeros(n) if r.residual is None else r.residual.clone()
            o = r.reduce(g)
            local = getattr(r, "last_indices", None)
            recs.append((g, before, o, r.residual.clone(), None if local is None else local.clone()))
        out[name] = recs
    return out


@pytest.mark.gloo
@pytest.mark.parametrize("P", list(range(1, 9)))
def test_gloo_conserving_consistent(P):
    n, steps = 1201, 3
    res = ss.run_local(_body, P, n, steps, backend="gloo", timeout=60)
    for name in NAMES:
        for t in range(steps):
            outs = [res[r][name][t][2] for r in range(P)]
            for o in outs[1:]:
                assert torch.equal(o, outs[0]), (name, t)
            lhs = sum(res[r][name][t][0].double() + res[r][name][t][1].double() for r in range(P))
            rhs = outs[0].double() + sum(res[r][name][t][3].double() for r in range(P))
            torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-4 * P)
    for t in range(steps):
        idx = torch.cat([res[r]["micro"][t][4] for r in range(P)])
        assert idx.unique().numel() == idx.numel()  # disjoint across ranks
