"""B-SAG controller (SparDL Algorithm 2) stays bounded in long runs: no windup of ``h``/``step``.

Regression: the stored ``h`` and ``step`` used to grow without bound while ``N_t <= L`` and
``round(inf)`` raised ``OverflowError`` at about step 2047 (P=4, teams=2, one non-zero per rank).
"""

import math

import torch

import sparsync as ss
from sparsync.spardl import HController


def _bounded(c: HController) -> bool:
    return (c.h_min <= c.h <= c.L and 1.0 <= abs(c.step) <= max(1.0, c.L - c.h_min)
            and math.isfinite(c.h) and math.isfinite(c.step))


def test_controller_10000_steps_each_regime():
    """Persistently sparse (N_t <= L), persistently dense (N_t > L) and alternating regimes."""
    regimes = {"sparse": lambda t, c: 1, "dense": lambda t, c: 10 * c.L,
               "alternating": lambda t, c: c.L + 1 if t % 3 else 0,
               "tracking": lambda t, c: int(2.5 * c.h_used)}  # N_t grows with h: settles near L
    for name, n_of in regimes.items():
        c = HController(P=12, d=3, k=12000)
        for t in range(10_000):
            c.update(n_of(t, c))
            assert _bounded(c), (name, t, c.state())
        if name == "sparse":
            assert c.h_used == c.L and c.h == c.L
        if name == "dense":
            assert c.h_used == c.h_min
        if name == "tracking":
            assert abs(2.5 * c.h_used - c.L) <= 2.5 * 2 * c.max_step


def test_controller_load_clamps_a_wound_up_state():
    c = HController(P=4, d=2, k=8)
    c.load({"h": 1e300, "step": float("inf"), "flag": True})
    assert _bounded(c) and c.h_used == c.L


def _sparse_run(comm, steps):
    """One non-zero per rank every step: N_t <= L forever (the case that overflowed)."""
    r = ss.make_reducer("spardl", comm, density=0.25, teams=2, team_allgather="b")
    n = 16
    states = []
    for _ in range(steps):
        g = torch.zeros(n, dtype=torch.float64)
        g[comm.rank] = 1.0
        r.reduce(g)
        states.append(dict(r._controllers[2].state()))
    ctl = r._controllers[2]
    return states, ctl.h_min, ctl.L, ctl.max_step


def test_reducer_long_sparse_run_stays_bounded():
    """Reducer level, P=2, d=2 (B-SAG): 2100 steps pass the old overflow point (~2047)."""
    res = ss.run_local(_sparse_run, 2, 2100)
    for states, h_min, L, max_step in res:
        assert states == res[0][0]  # both group members keep identical controllers
        for s in states:
            assert h_min <= s["h"] <= L and 1.0 <= abs(s["step"]) <= max_step, s
