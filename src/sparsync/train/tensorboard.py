"""``--tensorboard DIR``: live curves of running trainings in TensorBoard.

Rank 0 of every run appends one JSON line per step to ``<run>/metrics.jsonl``
(:mod:`sparsync.train.loop`). :class:`MetricsTail` follows those files from the launcher process on
a background thread and writes each new line to ``torch.utils.tensorboard.SummaryWriter`` — one
sub-directory per run, the step as TensorBoard's step — so the ranks do no extra work and every
workload and reducer is covered without touching the training loop. The last lines are flushed
when the context exits.

Scalars: ``loss``, ``accuracy`` and ``test_loss`` (evaluation steps), ``step_ms``, the engine's
``select_ms`` / ``comm_ms`` / ``wait_ms``, ``bytes_sent``, ``density``; ``loss_vs_time`` uses the
training wall-clock in milliseconds as the step (TensorBoard steps are integers).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

__all__ = ["MetricsTail", "require_tensorboard"]

_MS = ("step_s", "select_s", "comm_s", "wait_s")
_RAW = ("loss", "accuracy", "test_loss", "bytes_sent", "density")


def require_tensorboard():
    """torch's SummaryWriter, or a one-line error saying how to install what it needs."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError("--tensorboard needs the tensorboard package: pip install 'sparsync[tensorboard]' "
                          "(or pip install tensorboard)") from None
    return SummaryWriter


class MetricsTail:
    """Context manager: mirror ``[(label, run_dir), ...]``'s metrics.jsonl into ``logdir``."""

    def __init__(self, logdir, runs, poll_s: float = 0.5):
        self.SummaryWriter = require_tensorboard()
        self.logdir, self.runs, self.poll_s = Path(logdir), list(runs), poll_s
        self._stop = threading.Event()
        self._offsets: dict[str, int] = {}
        self._writers: dict[str, object] = {}
        self._thread = threading.Thread(target=self._loop, name="sparsync-tensorboard", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.poll()  # whatever the last steps wrote
        for w in self._writers.values():
            w.close()

    def _loop(self):
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> int:
        """Write every complete new line of every run; returns how many lines were written."""
        n = 0
        for label, run_dir in self.runs:
            path = Path(run_dir) / "metrics.jsonl"
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self._offsets.get(label, 0))
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
            if not end:
                continue
            self._offsets[label] = self._offsets.get(label, 0) + end
            w = self._writer(label)
            for line in chunk[:end].decode().splitlines():
                if line.strip():
                    self._write(w, json.loads(line))
                    n += 1
            w.flush()
        return n

    def _writer(self, label: str):
        if label not in self._writers:
            safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", label).strip("_")
            self._writers[label] = self.SummaryWriter(str(self.logdir / safe))
        return self._writers[label]

    @staticmethod
    def _write(w, rec: dict) -> None:
        step = int(rec.get("step", 0))
        for k in _RAW:
            if isinstance(rec.get(k), (int, float)):
                w.add_scalar(k, rec[k], step)
        for k in _MS:
            if isinstance(rec.get(k), (int, float)):
                w.add_scalar(k.replace("_s", "_ms"), 1e3 * rec[k], step)
        if isinstance(rec.get("time_s"), (int, float)):
            w.add_scalar("loss_vs_time", rec["loss"], int(1e3 * rec["time_s"]))
