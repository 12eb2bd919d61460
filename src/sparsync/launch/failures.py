"""How a rank's failure reaches the caller: the rank named on the exception, and the words of a lost peer.

The first exception on any rank is re-raised by the launcher with the same type, its message prefixed
``rank <r>:`` and a note carrying the rank's traceback (:func:`name_rank`); a failure with no
exception object (a crash, a stall) is a :class:`RankFailed`. A rank killed outright makes its peers
fail with gloo's connection errors (:func:`is_connection_error`): the launcher then names the dead
rank instead.
"""

from __future__ import annotations

import pickle

__all__ = ["RankFailed", "decode_report", "encode_report", "is_connection_error", "name_rank", "proc_state",
           "process_alive"]


def encode_report(payload) -> bytes:
    """A rank's report to its launcher, ``("ok", result)`` or ``("error", (exc, traceback))``, as bytes."""
    return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def decode_report(data: bytes):
    """:func:`encode_report`'s payload. It comes over a pipe from a child process this launcher
    started (as :mod:`multiprocessing` unpickles its own children's results), never from a file or a
    peer: exception objects and the user's return values need full pickling here, while state read
    from files or gathered from peers is loaded as data only (``torch.load(..., weights_only=True)``)."""
    return pickle.loads(data)


class RankFailed(RuntimeError):
    """A rank failed in a way that has no exception object to re-raise (crash, timeout)."""


def name_rank(exc: BaseException, rank: int, world_size: int, tb: str = "") -> BaseException:
    """``exc`` with ``exc.rank``, its message prefixed ``rank <r>:`` and a note naming the rank (with ``tb``)."""
    exc.rank = rank
    note = f"raised on rank {rank} of {world_size}"
    if tb:
        note += f"; traceback on that rank:\n{tb}"
    try:
        exc.add_note(note)
    except AttributeError:  # Python < 3.11
        pass
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("rank "):
        exc.args = (f"rank {rank}: {exc.args[0]}",) + exc.args[1:]
    return exc


_CONNECTION_WORDS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe",
                     "Connection refused", "Timed out", "timed out")


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` is gloo's report of a lost or silent peer (closed, reset, refused, timed out)."""
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in _CONNECTION_WORDS)


def proc_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (R, S, T = stopped, Z = zombie, ...); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    return proc_state(pid) not in (None, "Z", "X")
