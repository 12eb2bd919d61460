"""No orphans: rank processes die with their launcher, and what a dead launcher leaves is removed.

* A rank asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``) and also
  watches its parent pid from a thread (:func:`die_with_parent`, :func:`watch_parent`); it is named
  ``ss<launcher pid>r<rank>`` (:func:`rank_process_name`) so ``sparsync cluster cleanup`` can find
  leftovers of dead launchers.
* A *reaper* - a small process forked by the launcher (:func:`start_reaper`) - holds the read end of a
  pipe only the launcher writes. When the launcher dies without :func:`stop_reaper`, even by SIGKILL,
  the reaper sees the pipe close and runs the cleanup it was given: a ``run_local`` call's reaper
  runs the :func:`on_orphan` callbacks and removes the rendezvous store; an emulated cluster's deletes
  its namespaces.
* While ranks run, SIGTERM/SIGINT to the launcher raise in it (:func:`signals_stop_ranks`), so its
  ``finally`` kills the ranks and removes the store; the signal is then re-delivered to the handler
  that was installed before.

The reapers' pipes and the orphan callbacks are state of the whole process by nature - a forked child
must close every reaper pipe of its parent, whichever thread started the reaper - and live in one
:class:`Reapers` object (:data:`REAPERS`); each reaper takes a copy of the callbacks when it starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable

from .failures import RankFailed

__all__ = ["REAPERS", "Reapers", "die_with_parent", "on_orphan", "rank_process_name", "signals_stop_ranks",
           "start_reaper", "stop_reaper", "watch_parent"]

_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1
_libc = None


def rank_process_name(launcher_pid: int, rank: int) -> str:
    """The kernel name (``comm``, 15 chars max) of a rank process: ``ss<launcher pid>r<rank>``."""
    return f"ss{launcher_pid}r{rank}"


def prctl(option: int, arg) -> bool:
    """``prctl(option, arg)`` through libc; False where it is not available (not Linux)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        value = ctypes.c_char_p(arg) if isinstance(arg, bytes) else ctypes.c_ulong(int(arg))
        return _libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the parent-pid watch still works
        return False


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGKILL this process when its parent dies: ``prctl(PR_SET_PDEATHSIG)`` (fires when the
    parent's thread that started us ends) and a thread that watches the parent pid (belt and
    braces, and non-Linux). Exits at once if the parent is already gone."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    watch_parent(parent_pid)


def become_rank(parent_pid: int, rank: int, inherited_reapers: bool) -> None:
    """In a fresh rank process: get SIGKILL when the launcher dies, default signal dispositions.

    SIGTERM kills the rank; SIGINT is ignored (a terminal's Ctrl-C reaches the whole process group:
    the launcher decides, and kills the ranks). PR_SET_PDEATHSIG fires when the thread that forked
    us ends; that thread waits for the ranks' reports for as long as ranks run. A forked rank
    (``inherited_reapers``) closes the launcher's reaper pipes.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if inherited_reapers:
        REAPERS.close_inherited()
    prctl(_PR_SET_NAME, rank_process_name(parent_pid, rank).encode())
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)


def watch_parent(parent_pid: int) -> None:
    """Belt and braces for PR_SET_PDEATHSIG (and non-Linux): SIGKILL ourselves once reparented."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="sparsync-parent-watch", daemon=True).start()


class Reapers:
    """The reapers of this process (the write ends of their pipes) and the :func:`on_orphan` callbacks."""

    def __init__(self):
        self.fds: set[int] = set()  # closed in every forked child: only this process may hold them open
        self.orphan_callbacks: list[Callable[[], object]] = []

    def on_orphan(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Register ``fn`` for the reapers started from now on; returns a function that unregisters it."""
        self.orphan_callbacks.append(fn)

        def remove():
            with contextlib.suppress(ValueError):
                self.orphan_callbacks.remove(fn)

        return remove

    def close_inherited(self) -> None:
        """In a forked child: close the parent's reaper pipes (its reapers must see the parent's death)."""
        for fd in list(self.fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()

    def start(self, cleanup: Callable[[], object], name: bytes = b"sparsync-reaper") -> tuple[int, int] | None:
        """:func:`start_reaper`."""
        if not hasattr(os, "fork"):
            return None
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the reaper only reads
            pid = os.fork()
        if pid:
            os.close(r)
            self.fds.add(w)
            return pid, w
        try:  # the reaper
            os.close(w)
            self.close_inherited()  # other reapers must see their launcher's death, not wait for ours
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)  # it must outlive the launcher to clean up after it
            prctl(_PR_SET_NAME, name)
            said = b""
            while chunk := os.read(r, 64):
                said += chunk
            if b"done" not in said:
                time.sleep(0.1)  # the ranks get SIGKILL from the kernel; let them go first
                with contextlib.suppress(BaseException):
                    cleanup()
        finally:
            os._exit(0)

    def stop(self, reaper) -> None:
        """:func:`stop_reaper`."""
        if reaper is None:
            return
        pid, w = reaper
        self.fds.discard(w)
        with contextlib.suppress(OSError):
            os.write(w, b"done")
        with contextlib.suppress(OSError):
            os.close(w)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    def start_for_run(self, store_dir: str) -> tuple[int, int] | None:
        """The reaper of one ``run_local`` call: a copy of the orphan callbacks now, then the store."""
        callbacks = list(self.orphan_callbacks)

        def cleanup():
            for fn in callbacks:
                with contextlib.suppress(BaseException):
                    fn()
            shutil.rmtree(store_dir, ignore_errors=True)

        return self.start(cleanup)


#: the reapers of this process
REAPERS = Reapers()


def start_reaper(cleanup: Callable[[], object], name: bytes = b"sparsync-reaper") -> tuple[int, int] | None:
    """Fork a reaper that runs ``cleanup()`` if this process dies without :func:`stop_reaper` (even
    by SIGKILL: the reaper holds the read end of a pipe only this process writes, and sees it close).
    Returns (pid, pipe write end), or None where there is no fork."""
    return REAPERS.start(cleanup, name)


def stop_reaper(reaper) -> None:
    """Tell a reaper of :func:`start_reaper` that all went well (it exits without cleaning up)."""
    REAPERS.stop(reaper)


def on_orphan(fn: Callable[[], object]) -> Callable[[], None]:
    """Register ``fn()`` for the reaper: it runs when a launcher dies without cleaning up (SIGKILL).

    The reaper of a ``run_local`` call is forked when the call starts, with a copy of the callbacks
    registered by then. Returns a function that unregisters ``fn``.
    """
    return REAPERS.on_orphan(fn)


class _Terminated(BaseException):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


@contextlib.contextmanager
def signals_stop_ranks():
    """While ranks run, SIGTERM/SIGINT raise in the launcher, so ``finally`` kills the ranks and
    removes the store; then the previous handlers are restored and the signal is re-delivered to
    them (an EmulatedCluster's handler deletes its namespaces; SIG_DFL ends the process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        h = signal.getsignal(sig)
        if h is None or h == signal.SIG_IGN:  # a C handler we could not restore, or ignored: leave it
            continue
        prev[sig] = h
        signal.signal(sig, _raise_terminated)
    got = None
    try:
        yield
    except _Terminated as t:
        got = t.signum
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)
    if got is not None:
        os.kill(os.getpid(), got)  # the previous handler runs here (and usually raises or exits)
        raise RankFailed(f"the launcher received {signal.Signals(got).name}; every rank was stopped")
