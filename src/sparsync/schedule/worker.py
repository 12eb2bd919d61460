"""One daemon thread per rank that runs closures in FIFO order: the communication thread.

Used by :class:`~sparsync.schedule.engine.OverlapEngine` and by the asynchronous torch-DDP hook
(:class:`sparsync.ddp.DDPHook`). Every rank submits its collectives in the same order (plan order,
or DDP's bucket order), and a single FIFO thread keeps that order while the caller's thread (the
autograd engine) goes on computing: the overlap of MG-WFBP's Algorithm 2.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref

__all__ = ["CommWorker"]


class CommWorker:
    """A FIFO worker thread; ``submit(fn)`` runs ``fn()`` after everything submitted before it."""

    def __init__(self, name: str):
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _run(self):
        while True:
            fn = self._q.get()
            if fn is None:
                return
            fn()

    def submit(self, fn) -> None:
        self._q.put(fn)

    def close(self) -> None:
        """Stop the thread after the work already submitted (does not wait)."""
        self._q.put(None)

    def __getstate__(self):
        raise TypeError("a CommWorker (a live thread) cannot be pickled")


_LIVE: "weakref.WeakSet[CommWorker]" = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit, let every live worker finish what was submitted and stop (a few seconds at
    most each): a thread still inside a collective while the process tears down its process groups
    aborts the process ("terminate called without an active exception")."""
    for w in list(_LIVE):
        w.close()
        w._thread.join(timeout=5)
