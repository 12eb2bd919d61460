"""One table formatter for every report (benchmarks, training comparisons): text or Markdown."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]], markdown: bool = False,
                 first_left: bool = False) -> str:
    """Rows (dicts of already formatted or plain values) as an aligned text or Markdown table.

    ``columns`` is ``[(key, header), ...]``; missing keys print as ``-``. Text tables right-align every
    column, the first one left-aligned with ``first_left`` (a label column).
    """
    head = [h for _, h in columns]
    body = [[str(r.get(k, "-")) if r.get(k) is not None else "-" for k, _ in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def fmt(cells):
        return "  ".join(c.ljust(widths[i]) if first_left and i == 0 else c.rjust(widths[i])
                         for i, c in enumerate(cells))

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])
