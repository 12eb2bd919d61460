"""One daemon thread per rank that runs closures in FIFO order: the communication thread.

Used by :class:`~sparsync.schedule.engine.OverlapEngine` and by the asynchronous torch-DDP hook
(:class:`sparsync.ddp.DDPHook`). Every rank submits its collectives in the same order (plan order,
or DDP's bucket order), and a single FIFO thread keeps that order while the caller's thread (the
autograd engine) goes on computing: the overlap of MG-WFBP's Algorithm 2.
"""

from __future__ import annotations

import queue
import threading

__all__ = ["CommWorker"]


class CommWorker:
    """A FIFO worker thread; ``submit(fn)`` runs ``fn()`` after everything submitted before it."""

    def __init__(self, name: str):
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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
