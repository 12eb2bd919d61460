"""Scheduling: hide gradient communication behind the backward pass (MG-WFBP: Shi, Chu & Li, INFOCOM 2019).

* :mod:`.merge` — merge plans (``wfbp``, ``single``, ``buckets:<MB>``, ``mgwfbp`` = the paper's
  Algorithm 1, ``optimal`` = the exact dynamic program of the paper's §4.1) and the timeline model that
  predicts iteration time and non-overlapped communication for any plan.
* :mod:`.costmodel` — ``t = a + b*bytes`` per message: fitted from timed calls on the live group, or
  derived from the alpha-beta formulas.
* :mod:`.profiler` — per-tensor backward times.
* :mod:`.engine` — hooks + one communication thread per rank (used by :class:`sparsync.SparseDDP`).
* :mod:`.timeline` — Chrome-trace JSON writer.
"""

from .costmodel import CostModel
from .merge import STRATEGIES, evaluate, make_plan

__all__ = ["STRATEGIES", "CostModel", "evaluate", "make_plan"]
