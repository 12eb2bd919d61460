"""Cleanup that always happens: the open networks of this process, closed at exit and on SIGINT/SIGTERM.

A :class:`CleanupGuard` holds the networks that are open and the signal handlers they need. Signal
dispositions belong to the whole process, so there is one guard per process (:data:`GUARD`), and
its state is only live while a network is open: the first :meth:`~CleanupGuard.enter` installs its
handler for SIGINT and SIGTERM (from the main thread; a handler installed from C is left alone), the
last :meth:`~CleanupGuard.leave` puts the previous handlers back. The handler closes every open
network and then hands the signal to the handler that was there before - a Python callable is called,
an ignored signal stays ignored, the default disposition is restored and the signal re-delivered, so
the process ends the way it would have. Each open network is also closed by an ``atexit`` hook.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading

__all__ = ["GUARD", "CleanupGuard"]


class CleanupGuard:
    """The open networks of one process and the signal handlers installed for them (module docstring).

    A network is any object with an idempotent ``close()``. ``on_signal`` is the installed handler
    (one bound method for the guard's life, so ``signal.getsignal(...) is guard.on_signal`` holds).
    """

    def __init__(self, signals=(signal.SIGINT, signal.SIGTERM)):
        self.signals = tuple(signals)
        self._live: set = set()
        self._prev: dict[int, object] = {}
        self._lock = threading.RLock()  # re-entered when a signal arrives while this thread holds it
        self.on_signal = self._on_signal

    @property
    def live(self) -> frozenset:
        """The networks open now."""
        return frozenset(self._live)

    def enter(self, network) -> None:
        """``network`` is open: close it at exit and on SIGINT/SIGTERM until :meth:`leave`."""
        with self._lock:
            self._live.add(network)
            self._install()
        atexit.register(network.close)

    def leave(self, network) -> None:
        """``network`` is closed; the last one to leave restores the previous signal handlers."""
        with self._lock:
            self._live.discard(network)
            if not self._live:
                self._restore()
        with contextlib.suppress(Exception):  # may run from inside atexit itself
            atexit.unregister(network.close)

    def close_all(self) -> None:
        for net in list(self._live):
            net.close()

    def _on_signal(self, signum, frame):
        prev = self._prev.get(signum, signal.SIG_DFL)  # read first: closing the last network restores it
        self.close_all()
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:  # SIG_DFL: restore and re-deliver, so the process dies the way it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _install(self) -> None:
        if self._prev or threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            prev = signal.getsignal(sig)
            if prev is None:  # installed from C; we cannot chain it, leave it alone
                continue
            self._prev[sig] = prev
            signal.signal(sig, self.on_signal)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in list(self._prev.items()):
            if signal.getsignal(sig) is self.on_signal:
                signal.signal(sig, prev)
            del self._prev[sig]


#: the guard of this process (signal handlers are per process)
GUARD = CleanupGuard()
