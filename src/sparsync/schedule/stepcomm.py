"""One step's communication as the engine tracks it: the reducers' outputs, the guard's inputs, the
thread's error, a completion event and the step's accounting.

The overlap engine keeps one :class:`StepComm` per synchronised step. Without delay it lives for one
``backward()``; with ``delay=1`` (:mod:`sparsync.schedule.engine`, "Delayed averaging") it outlives
its step - it is applied at the end of the next backward - and is therefore part of the engine's
state: :meth:`StepComm.state_dict` holds the finished outputs (cloned: reducers recycle their output
buffers) so that a run resumed from a checkpoint applies exactly the average the original run would
have applied.
"""

from __future__ import annotations

import threading

import torch

from ..reducers.base import IndexedSum
from .stepstats import StepStats

__all__ = ["StepComm"]


class StepComm:
    """The communication of step ``step`` over ``groups`` groups (filled by the communication thread)."""

    __slots__ = ("step", "outs", "bad_local", "unused", "flags", "error", "done", "stats")

    def __init__(self, step: int, groups: int):
        self.step = step
        self.outs: list = [None] * groups      # per group: dense tensor, IndexedSum or sparse COO tensor
        self.bad_local: list[int] = []          # groups whose local gradient was non-finite (zeroed)
        self.unused: list[int] = []             # parameters without a gradient this step
        self.flags = None                       # the guard's flags (StepGuard.flags), set by the thread
        self.error = None                       # (group or -1, exception, traceback) from the thread
        self.done = threading.Event()           # set after the step's last job (the flag exchange)
        self.stats = StepStats()

    def raise_error(self, rank: int, groups) -> None:
        """Re-raise on the training thread what failed on the communication thread."""
        if self.error is None:
            return
        g, e, tb = self.error
        what = "the final flag exchange" if g < 0 else f"group {g} ({len(groups[g])} tensors)"
        raise RuntimeError(f"rank {rank}: SparseDDP communication of {what} (step {self.step}) failed: "
                           f"{type(e).__name__}: {e}\n{tb}") from e

    # ------------------------------------------------------------------ state (delay=1 only)
    def state_dict(self) -> dict:
        """The finished step, for a checkpoint (call after :attr:`done` is set)."""
        return {"step": self.step, "outs": [_out_state(o) for o in self.outs], "bad_local": list(self.bad_local),
                "unused": list(self.unused),
                "flags": None if self.flags is None else {int(r): list(f) for r, f in self.flags.items()}}

    @classmethod
    def from_state(cls, d: dict) -> StepComm:
        rec = cls(int(d["step"]), len(d["outs"]))
        rec.outs = [_out_from_state(o) for o in d["outs"]]
        rec.bad_local = list(d["bad_local"])
        rec.unused = list(d["unused"])
        rec.flags = None if d["flags"] is None else {int(r): list(f) for r, f in d["flags"].items()}
        rec.done.set()
        return rec


def _out_state(out):
    if isinstance(out, IndexedSum):
        return {"indices": out.indices.clone(), "values": out.values.clone(), "numel": int(out.numel)}
    return None if out is None else out.clone()


def _out_from_state(s):
    if isinstance(s, dict):
        return IndexedSum(s["indices"], s["values"], int(s["numel"]))
    if s is not None and not isinstance(s, torch.Tensor):
        raise ValueError("checkpoint: a pending reducer output must be a tensor or an indexed sum, "
                         f"got {type(s).__name__}")
    return s
