"""Runs as records: :func:`load_runs` (Python) and ``comparison.csv`` / ``comparison.json`` (files).

A record is one run's ``summary.json`` (what ``sparsync train`` / ``compare`` wrote) plus ``path``
(its directory) and the speed-ups over the dense SparseDDP run of the same comparison and round
(``compare --repeats / --seeds`` runs every configuration once per round; ``round``, ``repeat``,
``seed`` and ``config`` say which run it is):
``speedup_time_to_target`` (dense's time to target / this run's; None when either did not reach it)
and ``speedup_step`` (dense's median step time / this run's). ``with_metrics=True`` adds the
per-step lines of ``metrics.jsonl`` as ``metrics``.

    import sparsync.train as st
    runs = st.load_runs("runs/make-run")                  # a comparison, or one run directory
    best = min(runs, key=lambda r: r["time_to_target_s"] or float("inf"))

No torch and no pandas needed; ``pandas.DataFrame(load_runs(d))`` works when pandas is there.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from .ownership import atomic_write

__all__ = ["CSV_COLUMNS", "add_speedups", "load_runs", "write_comparison"]

#: the scalar columns of comparison.csv, in order (the JSON file holds every summary field)
CSV_COLUMNS = ["name", "config", "round", "repeat", "seed", "label", "workload", "reducer", "density", "merge",
               "workers", "network", "steps", "numel",
               "final_accuracy", "best_accuracy", "target_accuracy", "time_to_target_s", "steps_to_target",
               "time_to_target_eval_s", "train_time_s",
               "median_step_s", "median_compute_s", "median_select_s", "median_comm_s", "median_wait_s",
               "mean_step_s", "median_bytes_sent", "median_density", "final_train_loss",
               "speedup_time_to_target", "speedup_step"]


def _run_dirs(path: Path) -> list[Path]:
    """One run directory, or the runs of a comparison - ``<config>/summary.json`` (one run per
    configuration) and ``<config>/<round>/summary.json`` (``compare --repeats / --seeds``) - in the
    order of its ``comparison.json`` (as ``compare`` ran them); runs it does not list follow, by name."""
    if (path / "summary.json").exists():
        return [path]
    dirs = sorted({p.parent for p in (*path.glob("*/summary.json"), *path.glob("*/*/summary.json"))})
    try:
        listed = [Path(r["path"]).resolve() for r in json.loads((path / "comparison.json").read_text())["runs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return dirs
    order = {p: i for i, p in enumerate(listed)}
    return sorted(dirs, key=lambda d: (order.get(d.resolve(), len(order)), str(d)))


def add_speedups(records: list[dict]) -> list[dict]:
    """Set ``speedup_time_to_target`` and ``speedup_step`` relative to the dense SparseDDP record of
    the same round (``round`` field; records without one form one round)."""
    dense_of = {}
    for r in records:
        if r.get("reducer") == "dense":
            dense_of.setdefault(r.get("round", 0), r)
    for r in records:
        dense = dense_of.get(r.get("round", 0))
        tt, bt = r.get("time_to_target_s"), dense and dense.get("time_to_target_s")
        st, bs = r.get("median_step_s"), dense and dense.get("median_step_s")
        r["speedup_time_to_target"] = bt / tt if tt and bt else None
        r["speedup_step"] = bs / st if st and bs else None
    return records


def load_runs(path, with_metrics: bool = False) -> list[dict]:
    """Every run under ``path`` (a comparison directory, or one run directory) as a dict."""
    path = Path(path)
    dirs = _run_dirs(path)
    if not dirs:
        raise FileNotFoundError(f"no run (summary.json) in {path} or its sub-directories")
    out = []
    for d in dirs:
        rec = json.loads((d / "summary.json").read_text())
        rec["path"] = str(d)
        if with_metrics:
            from .runs import read_metrics

            rec["metrics"] = read_metrics(d / "metrics.jsonl")  # a torn last line: dropped, with a warning
        out.append(rec)
    return add_speedups(out)


def write_comparison(out_dir, records: list[dict], rows: list[dict] | None = None) -> tuple[Path, Path]:
    """``comparison.csv`` (one row per run, :data:`CSV_COLUMNS`) and ``comparison.json`` (full records,
    and ``rows``: the report's per-configuration medians and intervals, when given)."""
    out_dir = Path(out_dir)
    records = add_speedups([dict(r) for r in records])
    csv_path, json_path = out_dir / "comparison.csv", out_dir / "comparison.json"
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in records:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})
    atomic_write(csv_path, text.getvalue())  # whole or not at all; a failed write names the file
    atomic_write(json_path, json.dumps({"runs": records, **({"rows": rows} if rows is not None else {})}, indent=1,
                                       default=str))
    return csv_path, json_path
