"""SparDL worked examples (hand-worked example §1-4) and property tests of the building blocks."""

import pytest
import torch

import sparsync as ss
from sparsync.spardl import (
    HController,
    bags,
    block_topk,
    bruck_rounds,
    last_bag_size,
    num_steps,
    schedule,
    topk_det,
)

# ---------------------------------------------------------------- §1 bags and peers
P6_BAGS = {
    0: [[0], [1], [2, 3], [4, 5]], 1: [[1], [2], [3, 4], [5, 0]], 2: [[2], [3], [4, 5], [0, 1]],
    3: [[3], [4], [5, 0], [1, 2]], 4: [[4], [5], [0, 1], [2, 3]], 5: [[5], [0], [1, 2], [3, 4]],
}


def test_bags_p6_table():
    assert num_steps(6) == 3 and last_bag_size(6) == 2
    for w, want in P6_BAGS.items():
        assert bags(6, w) == want


def test_schedule_p6_transfers():
    # step 1: dist 4, B3: 0->4:{4,5} 1->5:{5,0} 2->0:{0,1} ...; step 2: dist 2, B2; step 3: dist 1, B1
    for w in range(6):
        s = schedule(6, w)
        assert [(d, j) for d, j, _, _ in s] == [(4, 3), (2, 2), (1, 1)]
        assert [dst for _, _, dst, _ in s] == [(w + 4) % 6, (w + 2) % 6, (w + 1) % 6]
        assert [src for _, _, _, src in s] == [(w - 4) % 6, (w - 2) % 6, (w - 1) % 6]
    assert bags(6, 2)[3] == [0, 1] and schedule(6, 2)[0][2] == 0  # erratum: rank 0 receives {0,1} from rank 2
    assert bags(6, 4)[2] == [0, 1] and schedule(6, 4)[1][2] == 0


def test_bags_p5():
    assert num_steps(5) == 3 and last_bag_size(5) == 1
    for w in range(5):
        assert bags(5, w) == [[w], [(w + 1) % 5], [(w + 2) % 5, (w + 3) % 5], [(w + 4) % 5]]
        assert [(d, j) for d, j, _, _ in schedule(5, w)] == [(4, 3), (2, 2), (1, 1)]


def _simulate_srs(P):
    held = [{b: [w] for b in range(P)} for w in range(P)]
    after = []
    for step in range(num_steps(P)):
        moves = []
        for w in range(P):
            _dist, j, dst, _src = schedule(P, w)[step]
            for b in bags(P, w)[j]:
                moves.append((dst, b, held[w].pop(b)))
        for dst, b, contrib in moves:
            assert b in held[dst], (P, step, dst, b)
            held[dst][b] = held[dst][b] + contrib
        after.append([dict(h) for h in held])
    return held, after


@pytest.mark.parametrize("P", list(range(2, 130)))
def test_srs_property_any_p(P):
    held, _ = _simulate_srs(P)
    for w in range(P):
        assert list(held[w]) == [w] and sorted(held[w][w]) == list(range(P))


def test_srs_p6_held_and_contributors():
    _, after = _simulate_srs(6)
    assert sorted(after[0][0]) == [0, 1, 2, 3] and sorted(after[1][0]) == [0, 1]
    assert sorted(after[0][0][0]) == [0, 2] and sorted(after[0][0][2]) == [0]
    assert sorted(after[0][4][0]) == [4] and sorted(after[0][4][4]) == [0, 4]
    assert sorted(after[1][0][0]) == [0, 2, 4] and sorted(after[1][5][0]) == [1, 3, 5]


# ---------------------------------------------------------------- §2 Bruck
def _simulate_bruck(p):
    bufs = [[r] for r in range(p)]
    log = []
    for s in range(len(bruck_rounds(p, 0))):
        rnd = [bruck_rounds(p, r)[s] for r in range(p)]
        sends = {r: (rnd[r][2], bufs[r][: rnd[r][1]]) for r in range(p)}
        log.append(sends)
        for r in range(p):
            src = rnd[r][3]
            dst, items = sends[src]
            assert dst == r
            bufs[r] = bufs[r] + items
    return bufs, log


def test_bruck_p5_trace():
    bufs, log = _simulate_bruck(5)
    assert len(log) == 3
    assert log[1][4] == (2, [4, 0]) and log[2][0] == (1, [0]) and log[0][1] == (0, [1])
    assert bufs == [[0, 1, 2, 3, 4], [1, 2, 3, 4, 0], [2, 3, 4, 0, 1], [3, 4, 0, 1, 2], [4, 0, 1, 2, 3]]


def test_bruck_p6_trace():
    bufs, log = _simulate_bruck(6)
    assert [c for _, c, _, _ in bruck_rounds(6, 0)] == [1, 2, 2]
    assert log[2][5] == (1, [5, 0]) and log[2][4] == (0, [4, 5]) and log[1][0] == (4, [0, 1])
    for r in range(6):
        assert bufs[r] == [(r + j) % 6 for j in range(6)]


@pytest.mark.parametrize("p", list(range(1, 130)))
def test_bruck_property(p):
    bufs, _ = _simulate_bruck(p)
    assert all(bufs[r] == [(r + j) % p for j in range(p)] for r in range(p))
    assert len(bruck_rounds(p, 0)) == (p - 1).bit_length()


# ---------------------------------------------------------------- §3 residual example, P = 4
G4 = torch.tensor([
    [4.0, 1.0, -2.5, 3.0, 1.0, 5.0, -1.0, 2.0],
    [1.0, -6.0, 2.0, 1.0, -3.0, 1.0, 4.0, 1.0],
    [-1.0, 2.0, 3.0, -5.0, 2.0, -1.0, 1.0, 6.0],
    [2.0, 1.0, -1.0, 2.0, 7.0, 3.0, -2.0, -1.0],
])
XI4 = torch.tensor([
    [0, 1, -2.5, -2, 1, 5, -1, 0],
    [1, -6, 2, 0, 0, 1, 4, 1],
    [-1, 2, 3, 0, 0, -1, 1, 0],
    [2, 1, -1, 0, 0, 3, -2, 0],
])


def _p4(comm, residuals):
    r = ss.make_reducer("spardl", comm, density=0.5, residuals=residuals)  # k = 4, kb = 1
    out = r.reduce(G4[comm.rank].clone())
    return out, r.residual.clone()


def test_p4_global_residual_example():
    res = ss.run_local(_p4, 4, "global")
    for out, _xi in res:
        assert torch.equal(out, torch.tensor([4.0, 0, 0, 3, 6, 0, 0, 7]))
    for w, (_, xi) in enumerate(res):
        assert torch.equal(xi, XI4[w]), (w, xi)
    assert torch.equal(G4.sum(0), res[0][0] + sum(x for _, x in res))


def test_p4_partial_and_local_lose_the_in_procedure_mass():
    # PRES: G elsewhere, own-selected surviving entries zeroed; LRES: every own-selected entry zeroed
    for mode in ("partial", "local"):
        res = ss.run_local(_p4, 4, mode)
        total = res[0][0] + sum(x for _, x in res)
        assert not torch.equal(total, G4.sum(0)), mode
    res = ss.run_local(_p4, 4, "partial")
    # index 3: sum G = 1, g_sum = 3 -> the true residual mass is -2 (GRES: w0 stores 3 + (-5)).
    # PRES keeps w0's own local 3 but loses w2's -5 that was forwarded and discarded at w0.
    assert float(sum(x for _, x in res)[3]) == 3.0
    assert float(XI4[:, 3].sum()) == -2.0


# ---------------------------------------------------------------- §4 Algorithm 2 trace
def test_bsag_h_trace():
    c = HController(P=12, d=3, k=12000)
    assert (c.h, c.step, c.L) == (1000, 20, 3000)
    rows = [(1000, 2400, 20, True, 1020), (1020, 2450, 40, False, 1060), (1060, 2500, 40, True, 1100),
            (1100, 2600, 80, False, 1180), (1180, 2800, 80, True, 1260), (1260, 3100, -40, False, 1220),
            (1220, 3200, -40, True, 1180), (1180, 2950, 20, False, 1200), (1200, 2980, 20, True, 1220),
            (1220, 3050, -10, False, 1210), (1210, 3010, -10, True, 1200), (1200, 2990, 5, False, 1205)]
    for h_used, n_t, step, flag, h_next in rows:
        assert c.h_used == h_used
        c.update(n_t)
        assert (c.step, c.flag, c.h) == (step, flag, h_next)


def test_controller_clamps():
    c = HController(P=4, d=2, k=8)  # h in [2, 4]
    for _ in range(20):
        c.update(100)  # always too many -> h goes down, clamped at ceil(k/P)
    assert c.h_used == 2


# ---------------------------------------------------------------- selection helpers
def test_block_topk_exact_sampled_and_fallback():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 200_000, generator=g)
    x[1] = 0
    x[1, :7] = 1.0  # too few nonzeros: sampled threshold 0 -> all candidates
    x[2, ::500] = 9.0  # structured row
    for k in (5, 300, 4000):
        a = block_topk(x, k)
        b = torch.topk(x.abs(), k, dim=1).indices
        assert torch.equal(x.abs().gather(1, a).sort(1).values, x.abs().gather(1, b).sort(1).values)
        assert all(a[i].unique().numel() == k for i in range(3))


def test_topk_det_breaks_ties_by_index():
    idx = torch.tensor([1, 3, 5, 7, 9])
    vals = torch.tensor([2.0, -3.0, 2.0, 2.0, 1.0])
    ki, _kv, di, _dv = topk_det(idx, vals, 3)
    assert ki.tolist() == [1, 3, 5] and di.tolist() == [7, 9]
