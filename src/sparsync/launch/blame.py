"""Naming the culprit when process ranks fail: the rank that stopped, died, or stalled, not its victims.

A rank that is stopped (SIGSTOP, a debugger) or killed outright makes its peers time out or lose
their connections; a rank that stops making progress makes the others' collectives time out. The
launcher's watch (:mod:`.processes`) asks these functions, in that order, whom to name: each raises
a :class:`~sparsync.launch.failures.RankFailed` naming the culprit, or returns when it finds none.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import signal
import time


from .failures import RankFailed, decode_report, is_connection_error, proc_state

__all__ = ["blame_dead", "blame_stopped", "blame_stuck", "how_died", "reported_cause", "stall_grace"]


def _stopped_ranks(procs, but: int | None = None) -> list[int]:
    """Ranks whose process is stopped (SIGSTOP, ^Z, a debugger): state T or t in /proc/<pid>/stat."""
    return [r for r, p in enumerate(procs) if r != but and proc_state(p.pid) in ("T", "t")]


def blame_stopped(procs, world_size, r, what: str) -> None:
    """A stopped rank makes the others time out: name it instead of the rank that timed out."""
    stopped = _stopped_ranks(procs, but=r)
    if stopped:
        pids = ", ".join(f"rank {s}: pid {procs[s].pid}" for s in stopped)
        raise RankFailed(f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} of {world_size} "
                         f"stopped responding (process stopped by SIGSTOP or a debugger; {pids}); "
                         f"{what}")


def how_died(p) -> str:
    """``killed by SIGKILL`` / ``exit code 3``: how process ``p`` ended."""
    code = p.exitcode
    if code is not None and code < 0 and -code in signal.valid_signals():
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def blame_dead(procs, world_size, r, what: str, wait_s: float = 2.0) -> None:
    """A rank killed outright makes its peers fail with gloo's "Connection closed by peer": when a
    peer of ``r`` has exited (within ``wait_s``) name it, not the rank that lost its connection."""
    end = time.monotonic() + wait_s
    while True:
        dead = [s for s, p in enumerate(procs) if s != r and p.exitcode not in (None, 0)]
        if dead or time.monotonic() >= end:
            break
        time.sleep(0.05)
    if dead:
        who = "; ".join(f"rank {s} of {world_size} died without reporting ({how_died(procs[s])})" for s in dead)
        raise RankFailed(f"{who}; {what}")


def reported_cause(pending, wait_s: float = 0.5):
    """A peer's error report already on its way that is not itself a lost connection: the cause of
    the connection errors its exit produced (it reported, then exited). ``(rank, (exc, tb))`` or None."""
    for c in mpc.wait(list(pending), timeout=wait_s):
        r = pending.pop(c)
        try:
            status, value = decode_report(c.recv_bytes())
        except (EOFError, OSError):
            continue
        if status == "error" and not is_connection_error(value[0]):
            return r, value
    return None


def stall_grace(timeout: float) -> float:
    """How long past the stall timeout the launcher waits before stopping the ranks itself, so that
    a collective that waited ``timeout`` in a rank reports first (naming the rank that did not
    answer): half the timeout, 30 s at most."""
    return min(30.0, 0.5 * timeout)


def blame_stuck(procs, world_size, r, exc, pending, timeout) -> None:
    """Rank ``r`` timed out in a collective (gloo's "Timed out"): the ranks that do not report the
    same within a moment are the ones that stopped making progress; name them."""
    if not (isinstance(exc, RuntimeError) and ("Timed out" in str(exc) or "timed out" in str(exc))):
        return
    end = time.monotonic() + 2.0  # the ranks that were waiting too report the same timeout meanwhile
    while (quiet := [c for c in pending if not c.poll()]) and time.monotonic() < end:
        mpc.wait(quiet, timeout=max(0.0, end - time.monotonic()))
    stuck = sorted(r2 for c, r2 in pending.items() if not c.poll() and procs[r2].exitcode is None)
    if stuck:
        pids = ", ".join(f"rank {s}: pid {procs[s].pid}" for s in stuck)
        raise RankFailed(f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} of {world_size} made no "
                         f"progress for {timeout:g} s (the stall timeout, --timeout; {pids}); rank {r} timed out "
                         f"waiting for {'them' if len(stuck) > 1 else 'it'} in a collective")
