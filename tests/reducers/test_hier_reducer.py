"""The hierarchical exchange (``make_reducer("hier", ...)``) on the thread backend: exact with a dense outer
reducer, bitwise identical on every rank for several site layouts, conserving with a sparse outer reducer,
its ledger split by level as the formula says, state resumes bitwise, bad layouts refused in one line."""

import pytest
import torch

import sparsync as ss
from sparsync.reducers.hier import HierReducer
from sparsync.reducers.registry import make_reducer
from sparsync.sites import check_layout, parse_layout, site_layout
from sparsync.threadcomm import ThreadWorld

# fp32 sums of P standard normals in another order: |error| <= P * eps * sum|x|, with margin
ATOL = 1e-5


def _grad(rank, step, n):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


def _run(comm, sites, outer, n, steps, density=0.05, **opts):
    r = make_reducer("hier", comm, density=density, outer=outer, sites=sites, **opts)
    rows = []
    for t in range(steps):
        g = _grad(comm.rank, t, n)
        before = r.residual
        out = r.reduce(g)
        rows.append({"g": g, "before": None if before is None else before.clone(), "out": out.clone(),
                     "after": r.residual, "stats": dict(r.stats)})
    return rows


LAYOUTS = [(4, [[0, 1], [2, 3]]), (4, [[0, 2], [1, 3]]), (6, "2x3"), (6, "3x2"), (8, "2x4"), (4, "1x4"),
           (4, "4x1"), (3, "3x1")]


@pytest.mark.parametrize("P,sites", LAYOUTS)
@pytest.mark.parametrize("n", [1, 97, 1000])
def test_dense_inner_and_outer_is_exact_and_consistent(P, sites, n):
    res = ss.run_local(_run, P, sites, "dense", n, 2, backend="thread")
    for t in range(2):
        ref = torch.stack([res[r][t]["g"] for r in range(P)]).double().sum(0)
        out = res[0][t]["out"]
        assert out.shape == (n,)
        assert torch.allclose(out.double(), ref, rtol=0, atol=ATOL * P), (out.double() - ref).abs().max()
        for r in range(P):
            assert torch.equal(res[r][t]["out"], out), f"rank {r} differs"
            assert res[r][t]["after"] is None or not res[r][t]["after"].any()  # dense keeps nothing


@pytest.mark.parametrize("outer,opts", [("micro", {}), ("topka", {}), ("cltk", {}), ("micro", {"value_dtype": "fp16"})])
@pytest.mark.parametrize("P,sites", [(4, "2x2"), (6, "2x3"), (6, "3x2"), (8, [[0, 4], [1, 5], [2, 6], [3, 7]])])
def test_sparse_outer_conserves_and_is_consistent(outer, opts, P, sites):
    steps, n = 4, 999
    res = ss.run_local(_run, P, sites, outer, n, steps, backend="thread", **opts)
    conserving = make_reducer("hier", ThreadWorld(P).comms()[0], outer=outer, **opts).conserving
    for t in range(steps):
        out = res[0][t]["out"]
        for r in range(P):
            assert torch.equal(res[r][t]["out"], out), f"step {t}: rank {r} differs"
        lhs = sum(res[r][t]["g"].double() + (0 if res[r][t]["before"] is None else res[r][t]["before"].double())
                  for r in range(P))
        rhs = out.double() + sum(res[r][t]["after"].double() for r in range(P))
        if conserving:
            assert torch.allclose(lhs, rhs, rtol=0, atol=ATOL * P), (t, (lhs - rhs).abs().max())


@pytest.mark.parametrize("P,sites", [(4, "2x2"), (6, "2x3"), (6, "3x2"), (8, "2x4")])
@pytest.mark.parametrize("n", [1000, 1001])
def test_ledger_split_by_level_matches_formula(P, sites, n):
    layout = parse_layout(sites, P)
    S, s = len(layout), len(layout[0])
    m = -(-n // s)
    for outer in ("dense", "micro"):
        res = ss.run_local(_run, P, sites, outer, n, 2, backend="thread")
        pred = HierReducer.predicted_cost(P, n, sites=sites, outer=outer, density=0.05)
        for r in range(P):
            st = res[r][1]["stats"]
            # reduce-scatter (direct) + all-gather (ring) inside the site: 2(s-1) m values each way
            assert st["intra_bytes"] == st["intra_bytes_received"] == 2 * (s - 1) * m * 4
            assert st["intra_rounds"] == 2 * (s - 1) == pred["intra"]["rounds"]
            assert st["intra_bytes"] == pred["intra"]["bytes_sent"]
            assert st["bytes_sent"] == st["intra_bytes"] + st["inter_bytes"]
            assert st["sites"] == f"{S}x{s}"
            if outer == "dense":  # the ring all-reduce of m values over S ranks
                assert st["inter_bytes"] == 2 * (S - 1) * m * 4 // S == pred["inter"]["bytes_received"]
                assert st["inter_rounds"] == 2 * (S - 1)
            else:  # micro's own formula on S ranks and m elements (bounds where it gives them)
                lo_hi = pred["inter"]["bytes_received"]
                lo, hi = lo_hi if isinstance(lo_hi, tuple) else (lo_hi, lo_hi)
                assert lo <= st["inter_bytes_received"] <= hi, (st["inter_bytes_received"], lo_hi)


def _resume(comm, n, steps, cut):
    a = make_reducer("hier", comm, density=0.05, outer="micro", sites="2x2")
    outs = []
    for t in range(steps):
        outs.append(a.reduce(_grad(comm.rank, t, n)).clone())
        if t == cut:
            state = a.state_dict()
    b = make_reducer("hier", comm, density=0.05, outer="micro", sites="2x2")
    b.load_state_dict(state)
    for t in range(cut + 1, steps):
        assert torch.equal(b.reduce(_grad(comm.rank, t, n)), outs[t]), f"step {t} differs after resume"
    return True


def test_state_resumes_bitwise():
    assert all(ss.run_local(_resume, 4, 500, 5, 1, backend="thread"))


def _assign_residual(comm, n):
    """A residual set from outside (SparseDDP regrouping) is added to the next input, never dropped."""
    r = make_reducer("hier", comm, density=0.05, outer="micro", sites="2x2")
    r.reduce(_grad(comm.rank, 0, n))
    full = r.residual.clone()
    r.residual = full
    assert torch.equal(r.residual, full)
    g = _grad(comm.rank, 1, n)
    out = r.reduce(g)
    return g, full, out, r.residual


def test_assigned_residual_is_conserved():
    res = ss.run_local(_assign_residual, 4, 300, backend="thread")
    lhs = sum(g.double() + b.double() for g, b, _, _ in res)
    rhs = res[0][2].double() + sum(a.double() for *_, a in res)
    assert torch.allclose(lhs, rhs, rtol=0, atol=ATOL * 4)


def test_site_layout_sources():
    assert site_layout(4, "2x2") == [[0, 1], [2, 3]]
    assert site_layout(4, [[3, 1], [2, 0]]) == [[0, 2], [1, 3]]
    assert site_layout(4, env={"SPARSYNC_SITES": "0,2;1,3"}) == [[0, 2], [1, 3]]
    assert site_layout(6, env={"LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1"}) == [[0, 1, 2], [3, 4, 5]]
    assert site_layout(4, env={}) is None
    with pytest.raises(ValueError, match="not a multiple"):
        site_layout(6, env={"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"})


@pytest.mark.parametrize("sites,match", [([[0, 1], [2]], "exactly once"), ([[0, 1, 2], [3]], "uneven"),
                                         ([[0, 1], [1, 2]], "exactly once"), ("3x2", "exactly once"),
                                         ("0,1;2,x", "expected"), ([[]], "non-empty"), ("bogus", "expected")])
def test_bad_layouts_refused_in_one_line(sites, match):
    with pytest.raises(ValueError, match=match) as e:
        make_reducer("hier", ThreadWorld(4).comms()[0], sites=sites)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=match):
        check_layout(sites, 4) if not isinstance(sites, str) else parse_layout(sites, 4)


@pytest.mark.parametrize("opts,err,match", [({"inner": "micro"}, ValueError, "inner"),
                                            ({"outer": "nosuch"}, ValueError, "unknown reducer"),
                                            ({"outer": "hier"}, ValueError, "itself"),
                                            ({"outer": "dense", "bins": 3}, TypeError, "unknown options: bins")])
def test_bad_options_refused(opts, err, match):
    with pytest.raises(err, match=match):
        make_reducer("hier", ThreadWorld(4).comms()[0], **opts)


def test_split_refuses_non_partitions():
    c = ThreadWorld(4).comms()[0]
    with pytest.raises(Exception, match="partition"):
        c.split([[0, 1], [1, 2, 3]])
