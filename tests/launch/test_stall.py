"""The stall timeout: ``run_local(timeout=T)`` (``sparsync train --timeout``) stops a run that made no
progress for T seconds, never one that keeps progressing; ``time_limit`` (``--time-limit``) is the
separate limit on the whole run. Real gloo processes; the ranks beat with ``sparsync.launch.progress``
as the training loop does once per step."""

import time

import pytest
import torch

import sparsync as ss
from sparsync.launch import RankFailed, progress

T = 3.0  # the stall timeout of these tests (seconds; a loaded 2-core machine must not stall a healthy step)


def _progressing(comm, seconds):
    """``seconds / 0.02`` steps of one all-reduce and a 0.02 s sleep each (so at least ``seconds``
    in all), beating after every step."""
    for _ in range(int(seconds / 0.02)):
        comm.allreduce(torch.ones(8))
        progress()
        time.sleep(0.02)
    return int(seconds / 0.02)


@pytest.mark.gloo
def test_a_progressing_run_longer_than_the_stall_timeout_completes():
    t0 = time.monotonic()
    steps = ss.run_local(_progressing, 2, 10.0, backend="gloo", timeout=T)
    took = time.monotonic() - t0
    assert took > 2 * T  # past T and past T + the launcher's grace (T/2): the timeout counts no progressing time
    assert steps == [500, 500]


def _stuck_rank(comm):
    """Rank 1 stops making progress after 5 steps (sleeps, as a rank stuck in a kernel or a
    deadlock would); rank 0 waits for it in its next all-reduce."""
    for i in range(1_000_000):
        if comm.rank == 1 and i == 5:
            time.sleep(3600)
        comm.allreduce(torch.ones(8))
        progress()


@pytest.mark.gloo
def test_a_stuck_rank_is_stopped_after_the_stall_timeout_and_named():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as e:
        ss.run_local(_stuck_rank, 2, backend="gloo", timeout=T)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert msg.startswith(f"rank 1 of 2 made no progress for {T:g} s (the stall timeout, --timeout"), msg
    assert "rank 0 timed out waiting for it" in msg
    assert took < 60  # stopped, not hung (the stall is ~T; the bound only says "not a hang")


def _all_stuck(comm):
    """Every rank stops beating and issues no collective (stuck outside communication)."""
    for _ in range(3):
        comm.allreduce(torch.ones(8))
        progress()
    time.sleep(3600)


@pytest.mark.gloo
def test_ranks_stuck_outside_collectives_are_stopped_by_the_launcher():
    want = rf"no progress for \d+ s \(the stall timeout, --timeout {T:g}\): ranks \[0, 1\]"
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=want):
        ss.run_local(_all_stuck, 2, backend="gloo", timeout=T)
    # stopped at the stall timeout plus the launcher's grace (T/2), not later: the deadline is T-sized
    # (a few seconds more for starting and stopping the ranks on a loaded machine)
    assert time.monotonic() - t0 < 1.5 * T + 8


@pytest.mark.gloo
def test_time_limit_stops_a_progressing_run():
    with pytest.raises(RankFailed, match=r"exceeded its time limit of 4 s \(--time-limit\)"):
        ss.run_local(_progressing, 2, 60.0, backend="gloo", timeout=T, time_limit=4.0)


def test_time_limit_on_thread_ranks():
    with pytest.raises(RankFailed, match=r"exceeded its time limit of 1 s"):
        ss.run_local(_progressing, 2, 60.0, backend="thread", timeout=30, time_limit=1.0)


def test_bad_limits_are_refused():
    for kw in ({"timeout": 0}, {"timeout": float("nan")}, {"time_limit": -1.0}):
        with pytest.raises(ValueError, match="positive seconds"):
            ss.run_local(_progressing, 2, 1.0, backend="thread", **kw)


def test_train_help_says_which_limit_is_which(capsys):
    from sparsync.cli import main

    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--timeout TIMEOUT stall timeout: stop the run when no training step completes" in out
    assert "a run that keeps progressing is never stopped by it" in out
    assert "--time-limit SECONDS stop the whole run after this many seconds, progressing or not" in out
