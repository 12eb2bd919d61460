"""Plain-text / Markdown tables and CSV output for the benchmark commands.

Why: every ``sparsync bench`` command prints the same kind of table (one row per configuration
and method, times in ms as median over steps of the max over ranks, speedup over dense) and writes
the same rows as CSV, so ``docs/benchmarks.md`` tables can be pasted from ``--markdown`` output.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Sequence

from ..tables import format_table

__all__ = ["fmt_bytes", "fmt_ms", "fmt_num", "fmt_speedup", "format_table", "write_csv"]


def fmt_ms(seconds) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def fmt_num(x) -> str:
    """Compact numbers: 10000000 -> 1e7, 0.001 -> 0.001, 2500000 -> 2.5e6."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, int) and abs(x) >= 10_000:
        m, e = f"{x:e}".split("e")
        m = m.rstrip("0").rstrip(".")
        return f"{m}e{int(e)}"
    return f"{x:g}" if isinstance(x, float) else str(x)


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


def fmt_speedup(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}x"


def write_csv(path: str, rows: Iterable[dict], fieldnames: Sequence[str] | None = None) -> None:
    """Write rows to ``path`` (directories created); list values are joined with ``;``."""
    rows = list(rows)
    if fieldnames is None:
        fieldnames = []
        for r in rows:
            fieldnames += [k for k in r if k not in fieldnames]
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fieldnames), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (";".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in r[k])
                            if isinstance(r.get(k), (list, tuple)) else r.get(k)) for k in fieldnames})
