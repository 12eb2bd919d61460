"""Thread ranks: ``run_local(..., backend="thread")`` on a :class:`~sparsync.threadcomm.ThreadWorld`.

Every rank is a thread of this process; the first exception aborts the world (every other rank
leaves its next collective with :class:`~sparsync.threadcomm.RankAborted`) and is re-raised here -
the root cause, not an abort it caused - with the rank named. ``time_limit`` aborts every rank at
its next collective.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

from ..threadcomm import RankAborted, ThreadWorld
from .failures import RankFailed, name_rank

__all__ = ["run_threads"]


def run_threads(fn, world_size, args, kwargs, timeout, alpha, beta, time_limit=None) -> list:
    """``fn(comm, *args, **kwargs)`` on ``world_size`` thread ranks; the results in rank order."""
    world = ThreadWorld(world_size, alpha=alpha, beta=beta, timeout=timeout)
    comms = world.comms()
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException, str]] = []

    def body(r):
        try:
            results[r] = fn(comms[r], *args, **kwargs)
        except RankAborted:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append((r, e, traceback.format_exc()))
            world.abort(f"rank {r} raised {type(e).__name__}: {e}")

    if world_size == 1:
        body(0)
    else:
        threads = [threading.Thread(target=body, args=(r,), name=f"sparsync-rank{r}", daemon=True)
                   for r in range(world_size)]
        for t in threads:
            t.start()
        end = None if time_limit is None else time.monotonic() + time_limit
        for t in threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in threads):  # past the time limit: stop every rank at its next collective
            world.abort(f"the run exceeded its time limit of {time_limit:g} s")
            raise RankFailed(f"the run exceeded its time limit of {time_limit:g} s (--time-limit); every rank was "
                             "stopped")
    if errors:
        # the root cause: the first error that is not a consequence of another rank's abort
        roots = [x for x in errors if not _caused_by_abort(x[1])]
        r, e, _ = (roots or errors)[0]
        raise name_rank(e, r, world_size)
    return results


def _caused_by_abort(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RankAborted):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
