"""A run's ``metrics.jsonl``: one JSON object per line, appended so that a cut-short write tears one line only.

Each record is written with a single ``write`` on an ``O_APPEND`` file (:class:`MetricsWriter`), so a
write cut short (a full disk, a kill) can only tear the last line; :func:`read_metrics` drops a torn
last line with a warning naming the file, and a failed write raises an ``OSError`` naming the file.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from .errors import CheckpointError

__all__ = ["MetricsWriter", "read_metrics"]


def read_metrics(path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (missing file: none). A torn last line - a write cut short
    by a full disk or a kill - is dropped with a warning naming the file; an unreadable line before
    the last is a :class:`CheckpointError` naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if not any(x.strip() for x in lines[i + 1:]):  # the last line: torn
                warnings.warn(f"{path}: ignoring its torn last line (a write cut short, e.g. by a full disk): "
                              f"{line[:60]!r}", RuntimeWarning, stacklevel=2)
                break
            raise CheckpointError(f"{path} line {i + 1} is not a metrics record ({e}); "
                                  "the file is damaged") from None
        out.append(rec)
    return out


class MetricsWriter:
    """Appends one record per line to ``metrics.jsonl``: each line one ``os.write`` on an
    ``O_APPEND`` descriptor (a cut-short write tears only the last line, which :func:`read_metrics`
    drops); a failed write raises ``OSError`` with the file named (a full disk says where)."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def write(self, rec: dict) -> None:
        data = (json.dumps(rec) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} (writing the metrics file)", str(self.path)) from None

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
