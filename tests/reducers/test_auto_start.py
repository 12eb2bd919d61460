"""The start decision of ``reducer="auto"``: it cannot measure the kept mass under error feedback or the
step's compute yet, so it estimates the first (:func:`~sparsync.autotune.kept.kept_under_feedback`) and
is told the second by its caller (``compute_start``, which SparseDDP sets); while a dense candidate
runs, the estimate is made again for the periodic decisions only. Real thread ranks."""

import math
import time

import torch
from torch import nn

import sparsync as ss
from sparsync.autotune.kept import kept_under_feedback
from sparsync.reducers.registry import make_reducer

N, P = 20000, 3
# a declared link on which dense costs ~30 ms per call at N values and micro 1 % about 1 ms
LINK = {"flat": (1e-4, 0.03 / (2 * (P - 1) / P * N * 4))}


def _heavy(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).double()


def _kept(x, k):
    sq = x * x
    return float(sq.topk(k).values.sum() / sq.sum())


def test_kept_under_feedback_is_the_error_feedback_loop():
    x = _heavy(50000, 0)
    for d in (0.01, 0.05):
        k = math.ceil(d * x.numel())
        for steps in (0, 1, 2, 3):
            residual = torch.zeros_like(x)  # error feedback written out: send the top k of residual + x, keep the rest
            for _ in range(steps):
                acc = residual + x
                sent = torch.zeros_like(acc)
                top = acc.abs().topk(k).indices
                sent[top] = acc[top]
                residual = acc - sent
            want = _kept(residual + x, k)
            assert math.isclose(kept_under_feedback(x, k, steps), want, rel_tol=1e-12), (d, steps)
        # the accumulated vector spreads: each step of feedback keeps less in the top k
        seq = [kept_under_feedback(x, k, s) for s in range(4)]
        assert math.isclose(seq[0], _kept(x, k), rel_tol=1e-12) and all(a > b for a, b in zip(seq, seq[1:])), seq


def _start(comm, hint):
    r = make_reducer("auto", comm, candidates="dense,micro:0.01", link=LINK)
    if hint is not None:  # each rank was told another start of its compute; the decision takes the maximum
        r.compute_start = time.perf_counter() - hint * (comm.rank + 1) / P
    r.reduce(_heavy(N, comm.rank).float())
    return r.decisions[0]["chosen"], r.last_decision["gap_ms"]


def test_the_start_weighs_the_candidates_against_the_compute_it_was_told():
    # no compute time: micro's 1 ms beats dense's 30 ms whatever its convergence cost; behind 300 ms
    # of compute, dense's exact step is worth its 30 ms
    told = ss.run_local(_start, P, 0.3, backend="thread")
    untold = ss.run_local(_start, P, None, backend="thread")
    assert all(c == "dense" and g >= 300 for c, g in told), told
    assert all(c == "micro:0.01" and g == 0 for c, g in untold), untold


def _ddp(comm):
    m = nn.Sequential(nn.Linear(20, 50), nn.ReLU(), nn.Linear(50, 2))
    ddp = ss.SparseDDP(m, comm, reducer="auto", merge="single",
                       reducer_options={"candidates": "dense,micro:0.05", "link": LINK})
    ddp(torch.randn(8, 20)).square().mean().backward()
    gap = ddp.reducers[0].last_decision["gap_ms"]
    ddp.close()
    return gap


def test_sparseddp_tells_auto_when_the_compute_started():
    assert all(g > 0 for g in ss.run_local(_ddp, 2, backend="thread"))


def _estimates(comm, calls):
    r = make_reducer("auto", comm, candidates="dense,micro:0.01,micro:0.05", link={"flat": (1e-6, 1e-12)},
                     check_every=2, decide_every=10, warmup=1)
    # every call as fast as dense's model says (no decision from a busy core)
    r.timings = lambda r, ev: {**ev, "total_s": 2e-5} if ev["event"] == "call" else ev
    for t in range(calls):
        r.reduce(_heavy(N, 10 * t + comm.rank).float())
    return r.choice, [d["reason"] for d in r.decisions]


def test_while_dense_runs_the_kept_mass_estimate_is_made_for_decisions_only(monkeypatch):
    # a fast link: dense from the start; checks every 2 calls, a periodic decision every 10: the
    # estimate (for each of the three default densities) at the start and for the periodic decisions
    # only, not at every check
    import threading

    import sparsync.autotune.kept as kept_module

    made, lock, real = [], threading.Lock(), kept_module.kept_under_feedback

    def counted(x, k, steps=2):
        with lock:
            made.append(k)
        return real(x, k, steps)

    monkeypatch.setattr(kept_module, "kept_under_feedback", counted)
    res = ss.run_local(_estimates, 2, 25, backend="thread")
    choice, reasons = res[0]
    assert all(r == res[0] for r in res) and choice == "dense" and reasons.count("periodic") == 2, res
    # ranks x densities x (the start, the first window's and the periodic decisions)
    assert len(made) == 2 * 3 * (2 + reasons.count("periodic")), (len(made), reasons)
