"""Chrome-trace timeline (``chrome://tracing`` / Perfetto JSON), one file per rank, like Horovod's.

Rows (``tid``): ``backward`` (one slice per gradient tensor, from the previous tensor's ready time
to its own), ``comm`` (one slice per group's reducer call), ``wait`` (time the end of backward waited
for communication). Times are microseconds since the engine started. Only the latest
``max_steps`` steps are kept; the file is rewritten after every step (small: a few KB per step).
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["Timeline", "rank_path"]


def rank_path(path: str, rank: int, world_size: int) -> str:
    """``path`` with ``{rank}`` filled in, or ``.rank<r>`` before the extension when P > 1."""
    if "{rank}" in path:
        return path.format(rank=rank)
    if world_size == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Timeline:
    def __init__(self, path: str, rank: int, world_size: int, max_steps: int = 50):
        self.path = rank_path(path, rank, world_size)
        self.rank = rank
        self.t0 = time.perf_counter()
        self.max_steps = max_steps
        self.steps: list[list[dict]] = []
        self.cur: list[dict] = []

    def slice(self, row: str, name: str, start: float, end: float, **args) -> None:
        """A complete event from perf_counter ``start`` to ``end``."""
        self.cur.append({"name": name, "ph": "X", "pid": self.rank, "tid": row,
                         "ts": (start - self.t0) * 1e6, "dur": max(0.0, end - start) * 1e6,
                         "args": args})

    def end_step(self) -> None:
        self.steps.append(self.cur)
        self.cur = []
        del self.steps[:-self.max_steps]
        self.write()

    def write(self) -> None:
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        for s in self.steps:
            events.extend(s)
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)
