"""The rules of ``reducer="auto"`` (its module docstring), each against a run that only that rule
decides: the margin (3), periodic decisions (6) and the residual handed over through auto's
``ErrorFeedback`` on a switch (8). Real thread ranks, call times injected."""

import pytest
import torch

import sparsync as ss
from sparsync.reducers.memory import ErrorFeedback
from sparsync.reducers.registry import make_reducer

N, P = 20000, 4
FAST = {"flat": (1e-6, 1e-10)}  # every wire under 0.1 ms: dense starts


def _grad(rank, step):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank)
    return torch.randn(N, generator=g)


def _margin_run(comm, ratio, margin):
    """dense (the start's choice) measures ``ratio`` times micro's modelled time per call; no
    compute gap, no convergence cost (penalty 0): the scores are the times."""
    r = make_reducer("auto", comm, candidates="dense,micro:0.05", link=FAST, check_every=2, warmup=1,
                     penalty=0.0, margin=margin)
    micro = r.candidates[1]

    def hook(r, ev):
        if ev["event"] == "call":
            return {**ev, "total_s": ratio * r._time(micro, N) if r.choice == "dense" else ev["total_s"]}
        return {**ev, "gap_s": 0.0} if ev["event"] == "window" else ev
    r.timings = hook
    for t in range(4):
        r.reduce(_grad(comm.rank, t))
    return [(d["step"], d["chosen"]) for d in r.decisions]


@pytest.mark.parametrize("ratio,margin,stays", [(1.05, 0.1, True), (1.2, 0.1, False), (1.05, 0.0, False),
                                                (0.95, 0.1, True)])
def test_the_active_candidate_stays_unless_another_scores_margin_lower(ratio, margin, stays):
    # rule 3: at the first window (step 2) dense has measured `ratio` x micro's time: with a 10 %
    # margin 1.05x keeps dense, 1.2x moves to micro; without a margin 1.05x moves too
    res = ss.run_local(_margin_run, P, ratio, margin, backend="thread")
    assert all(d == res[0] for d in res)
    assert res[0] == [(0, "dense"), (2, "dense" if stays else "micro:0.05")], res[0]


def _periodic(comm, decide_every):
    r = make_reducer("auto", comm, candidates="dense,micro:0.05", link=FAST, check_every=2, warmup=1,
                     decide_every=decide_every)
    r.timings = lambda r, ev: {**ev, "total_s": 1e-4} if ev["event"] == "call" else ev  # on time, always
    for t in range(16):
        r.reduce(_grad(comm.rank, t))
    return [(d["step"], d["reason"]) for d in r.decisions]


def test_decisions_come_at_the_first_window_and_every_decide_every_calls():
    # rule 6: no window is off, yet the choice is made again at the first window (step 2) and then
    # every 6 calls (steps 8 and 14)
    res = ss.run_local(_periodic, P, 6, backend="thread")
    assert all(d == res[0] for d in res)
    assert res[0] == [(0, "start"), (2, "first measurements"), (8, "periodic"), (14, "periodic")], res[0]


def _handover(comm):
    r = make_reducer("auto", comm, candidates=["micro:0.05", "topka:0.05"], link=FAST, check_every=1000)
    for t in range(3):
        r.reduce(_grad(comm.rank, t))
    old = r._cand.residual.clone()
    r._switch(1)  # what a decision does
    carried = r.memory.residual
    held = (isinstance(r.memory, ErrorFeedback) and carried is not None and torch.equal(carried, old)
            and r._cand.residual is None and torch.equal(r.residual, old))
    g = _grad(comm.rank, 3)
    out = r.reduce(g)
    return held, r.memory.residual is None, g + old, out, r.residual


def test_a_switch_hands_the_residual_over_through_auto_s_error_feedback():
    # rule 8: the outgoing candidate's residual is auto's ErrorFeedback residual until the next call,
    # which gives the new candidate grad + residual: what it sends plus what it keeps is that sum
    res = ss.run_local(_handover, 2, backend="thread")
    assert all(held and gone for held, gone, *_ in res)
    total_in = sum(acc.double() for _, _, acc, _, _ in res)
    total_out = res[0][3].double() + sum(after.double() for *_, after in res)
    assert torch.allclose(total_in, total_out, rtol=0, atol=1e-4)
