"""Reports of several runs side by side: ``report.md`` + PNG plots (matplotlib, Agg backend).

Input: run directories written by :mod:`sparsync.train.loop` (``summary.json``, ``metrics.jsonl``,
``config.json``). A comparison may hold several runs of each configuration - one per *round*
(a repeat, or another seed; ``sparsync compare --repeats R --seeds S``): every number of the table
is then the median over the configuration's runs with a 95 % bootstrap interval of that median
(:mod:`sparsync.train.stats`), and ratios between two rows are taken within each round (same
repeat, same seed) before they are summarised the same way.

Output, in the comparison directory:

* ``accuracy_vs_time.png``  held-out accuracy against training wall-clock (evaluation excluded);
* ``loss_vs_time.png``      training loss (rank 0, mean of the last 5 steps) against wall-clock;
* ``time_to_target.png``    each configuration's time to target: every run as a dot, the median and
  its interval as a bar;
* ``step_breakdown.png``    median time per step: the main thread's compute (forward + backward
  compute + optimizer) and wait (reduction not hidden behind backward), next to the reducers' own
  selection and communication time (which may overlap backward); torch DDP has no split (its
  all-reduce runs inside backward), shown as one bar;
* ``bytes_per_step.png``    median bytes sent per rank per step (log scale);
* ``density.png``           achieved density per step of the sparse runs;
* ``report.md``             the table (one row per configuration: median and mean step - the mean counts
  the rare synchronising steps of local-step rows, which the median hides) and every run's own numbers.

Plots use short row names (``micro 2% +mc+wu+fp16``; the table maps each to its full
configuration), keep the legend to the right of the axes, and draw the range of a configuration's
runs as a band around their median where there are several.

**The floor.** ``x floor`` divides a row's step time by the round's floor: the least *compute*
time per step measured in that round - the compute part (forward + backward compute + optimizer,
rank 0's median) of any row's own step breakdown, the no-communication row's whole step, or a torch
DDP row's whole step (its compute cannot be separated from its all-reduce). Every row's step is at
least its own compute part, so no row can come out below the floor; and compute measured inside a
communicating row ran under that row's CPU share, not under the no-communication row's contention
(4 ranks computing at once on fewer cores).

Time to target: training wall-clock when the held-out metric first reaches the target, linearly
interpolated between the evaluations either side of the crossing (:func:`sparsync.train.stats.crossing`).

This module writes the report and its tables; the rows' names and numbers are
:mod:`sparsync.train.rows`, the plots :mod:`sparsync.train.plots`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..tables import format_table as _format_table
from .plots import (_MARKERS, _STYLES, LOG_SPAN, _band, _draw_rows, _finish_time_plot,  # noqa: F401
                    _finite, _legend_outside, _median_curve, _plot_curves, _plot_step_breakdown_and_per_step,
                    _plot_time_to_target, _style)
from .rows import (_TAGS, _TORCH_SHORT, _is_baseline, _iv, _key, _max_rank, _round, aggregate,  # noqa: F401
                   floors, ratio_to, short_label, short_labels)

# the rows (labels, numbers) and the plots live in their own modules; their names stay importable from here
__all__ = ["aggregate", "floors", "format_table", "ratio_to", "short_label", "short_labels", "table_rows",
           "write_report"]

def _load(run_dir: Path) -> tuple[dict, list[dict]]:
    s = json.loads((run_dir / "summary.json").read_text())
    cf = run_dir / "config.json"
    if cf.exists() and "reducer_options" not in s:
        c = json.loads(cf.read_text())
        s = {**s, "reducer_options": c.get("reducer_options") or {}, "ddp_options": c.get("ddp_options") or {}}
    from .runs import read_metrics

    m = read_metrics(run_dir / "metrics.jsonl")  # a torn last line: dropped, with a warning
    return s, m


def _ms(iv):
    return "–" if iv is None else iv.format(lambda x: f"{1e3 * x:.1f}")


def _fmt(iv, f, inf="not reached"):
    return "–" if iv is None else iv.format(f, inf=inf)


def table_rows(summaries: list[dict]) -> list[dict]:
    """One formatted row per configuration (:func:`aggregate`); a value with an interval reads
    ``median [low, high]``."""
    rows = []
    for a in aggregate(summaries):
        sp = a["speedup"]
        rows.append({
            "short": a["short"], "config": a["label"], "n": a["n"],
            "step_ms": _ms(a["step_s"]), "step_mean_ms": _ms(a["mean_step_s"]), "compute_ms": _ms(a["compute_s"]),
            "x_floor": _fmt(a["x_floor"], lambda x: f"{x:.2f}"),
            "select_ms": _ms(a["select_s"]), "comm_ms": _ms(a["comm_s"]), "select_mean_ms": _ms(a["mean_select_s"]),
            "wait_ms": _ms(a["wait_s"]),
            "mb_step": _fmt(a["bytes"], lambda x: f"{x / 1e6:.3f}"),
            "mb_step_mean": _fmt(a["mean_bytes"], lambda x: f"{x / 1e6:.3f}"),
            "density": _fmt(a["density"], lambda x: f"{x:.4f}"),
            "steps_to_target": _fmt(a["steps_to_target"], lambda x: f"{x:.1f}"),
            "time_to_target": _fmt(a["time_to_target_s"], lambda x: f"{x:.2f} s"),
            "final_acc": _fmt(a["final_accuracy"], lambda x: f"{100 * x:.2f} %"),
            "r": _fmt(a["link_ratio"], lambda x: f"{x:.1f}"),
            "util": _fmt(a["utilisation"], lambda x: f"{100 * x:.0f} %"),
            "vs_dense": "–" if sp is None else _fmt(sp, lambda x: f"{x:.2f}x", inf="inf") +
            (" step" if a["speedup_kind"] == "step" else ""),
        })
    return rows


_COLS = [("short", "row"), ("step_ms", "step ms"), ("step_mean_ms", "step ms (mean)"), ("x_floor", "x floor"),
         ("compute_ms", "compute ms"), ("select_ms", "select ms"), ("select_mean_ms", "select ms (mean, slowest rank)"),
         ("comm_ms", "comm ms"), ("wait_ms", "wait ms"), ("mb_step", "MB sent/step"),
         ("mb_step_mean", "MB sent/step (mean)"), ("density", "density"), ("steps_to_target", "steps to target"),
         ("time_to_target", "time to target"), ("final_acc", "final acc"), ("r", "r"), ("util", "compute util"),
         ("vs_dense", "speed-up vs dense"),
         ("n", "runs"), ("config", "configuration")]


#: the terminal's table: the columns a verdict reads, then which row is which configuration (the mean step and
#: bytes beside the median step: a local-step row's median step sends nothing)
_TERMINAL = ("short", "step_ms", "step_mean_ms", "x_floor", "compute_ms", "wait_ms", "mb_step_mean", "steps_to_target",
             "time_to_target", "final_acc", "r", "util", "vs_dense", "n")


def format_table(rows: list[dict], markdown: bool = True, compact: bool = False) -> str:
    """The comparison table (columns :data:`_COLS`), Markdown or aligned text; ``compact``: the
    columns of :data:`_TERMINAL`, followed by one line per row naming its full configuration."""
    if not compact:
        return _format_table(rows, _COLS, markdown=markdown, first_left=True)
    cols = [c for c in _COLS if c[0] in _TERMINAL]
    key = [f"  {r['short']}: {r['config']}" for r in rows if r["short"] != r["config"]]
    return _format_table(rows, cols, markdown=markdown, first_left=True) + ("\nrows:\n" + "\n".join(key) if key else "")


def _run_table(summaries: list[dict]) -> str:
    """Every run's own numbers (round, seed, step, x floor, time and steps to target)."""
    fl, names = floors(summaries), short_labels(summaries)
    rows = []
    for s in sorted(summaries, key=lambda s: (_round(s), s.get("config_index", 0))):
        f = fl.get(_round(s))
        tt, st = s.get("time_to_target_s"), s.get("steps_to_target")
        rows.append({"round": _round(s), "repeat": s.get("repeat", 0), "seed": s.get("seed"), "row": names[_key(s)],
                     "step": "–" if s.get("median_step_s") is None else f"{1e3 * s['median_step_s']:.1f}",
                     "floor": "–" if not f else f"{1e3 * f:.1f}",
                     "x_floor": "–" if not f or s.get("median_step_s") is None else f"{s['median_step_s'] / f:.2f}",
                     "steps": "not reached" if tt is None else ("–" if st is None else f"{st:.1f}"),
                     "tt": "not reached" if tt is None else f"{tt:.2f} s",
                     "acc": "–" if s.get("final_accuracy") is None else f"{100 * s['final_accuracy']:.2f} %",
                     "dir": f"`{s.get('path', '')}`"})
    cols = [("round", "round"), ("repeat", "repeat"), ("seed", "seed"), ("row", "row"), ("step", "step ms"),
            ("floor", "round's floor ms"), ("x_floor", "x floor"), ("steps", "steps to target"),
            ("tt", "time to target"), ("acc", "final acc"), ("dir", "run directory")]
    return _format_table(rows, cols, markdown=True)


# ---------------------------------------------------------------------------------------------- report
def write_report(out_dir: str | Path, run_dirs: list[str | Path], title: str, notes: list[str] | None = None) -> Path:
    """Write plots and report.md into ``out_dir``; returns the report path."""
    from ..extras import require

    require("matplotlib", "plots", "the comparison report").use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for d in run_dirs:
        s, m = _load(Path(d))
        runs.append(({**s, "path": str(d)}, m))
    summaries = [s for s, _ in runs]
    agg = aggregate(summaries)
    metrics = {id(s): m for s, m in runs}
    s0 = summaries[0] if summaries else {}
    metric = s0.get("target_metric") or "accuracy"
    target = s0.get("target_value", s0.get("target_accuracy"))

    _plot_curves(plt, agg, metrics, title, target, metric, out_dir)
    _plot_time_to_target(plt, agg, title, out_dir)
    _plot_step_breakdown_and_per_step(plt, runs, summaries, out_dir)

    n_rounds = len({_round(s) for s in summaries})
    lines = [f"# {title}", ""]
    lines += [(f"- workload `{s0.get('workload')}`, {s0.get('workers')} workers, network `{s0.get('network')}`, "
               f"{s0.get('steps')} steps, target: held-out {metric} {target}"
               + (f" on {s0['n_heldout']} held-out examples" if s0.get("n_heldout") else "")
               + (f", evaluated every {s0['eval_every']} steps" if s0.get("eval_every") else "")), ""]
    if n_rounds > 1:
        lines += [f"- {n_rounds} rounds (every configuration ran once per round, round-robin: A B C, A B C, ...); "
                  "each value is the median over the rounds with its 95 % bootstrap interval `[low, high]` "
                  "(2000 resamples, fixed seed; with fewer than 6 runs that interval is the runs' range); ratios "
                  "are taken within each round first", ""]
    notes = list(notes or [])
    notes += [c for c in network_caveats(s0.get("network")) if not any("loopback" in n.lower() for n in notes)]
    for n in notes:
        lines.append(f"- {n}")
    if notes:
        lines.append("")
    lines += [format_table(table_rows(summaries)), "",
              ("Step times are medians after 3 warm-up steps (rank 0). `select ms (mean, slowest rank)` is the "
               "largest per-rank mean: it shows selection that happens on some steps only, e.g. CLT-k's rotating "
               "leader. `comm` is the reducers' own time and may "
               "overlap backward; `wait` is the communication left after backward. torch DDP rows have no split "
               "(their all-reduce runs inside backward); their bytes are the ring all-reduce formula. "
               "`x floor` = step time / the round's floor, the least compute time per step of any row in that "
               "round: the compute part (forward + backward compute + optimizer) of a row's own step breakdown, "
               "or the whole step of a row without a split (the no-communication row, torch DDP). Each row's step "
               "is at least its own compute, so no row comes out below the floor. "
               "Time and steps to target are interpolated between the evaluations either side of the crossing. "
               "`speed-up vs dense` is dense SparseDDP's time to target / this row's, in the same round; "
               "`step` marks the median step-time ratio, shown when some run of this row or of dense did not "
               "reach the target. The same numbers as data: `comparison.csv`, `comparison.json`."), ""]
    for f, cap in (("accuracy_vs_time.png", "accuracy vs wall-clock"), ("time_to_target.png", "time to target"),
                   ("loss_vs_time.png", "loss vs wall-clock"), ("step_breakdown.png", "time per step"),
                   ("bytes_per_step.png", "bytes per step"), ("density.png", "achieved density")):
        lines += [f"![{cap}]({f})", ""]
    lines += ["## Every run", "", _run_table(summaries), ""]
    lines += _auto_section(summaries)
    p = out_dir / "report.md"
    p.write_text("\n".join(lines))
    return p


def _auto_section(summaries: list[dict]) -> list[str]:
    """``reducer="auto"`` runs: each decision (step, merge group, reason, what it chose)."""
    runs = [s for s in summaries if s.get("auto_decisions")]
    if not runs:
        return []
    lines = ["## reducer=auto: its decisions", ""]
    for s in runs:
        lines += [f"`{s.get('path', s.get('name'))}` (final choice `{s.get('auto_final_choice')}`):", ""]
        rows = [{"step": d["step"], "group": "–" if d.get("group") is None else d["group"], "reason": d["reason"],
                 "chosen": f"`{d['chosen']}`" + ("" if d.get("switched") else " (kept)")} for d in s["auto_decisions"]]
        lines += [_format_table(rows, [("step", "step"), ("group", "group"), ("reason", "reason"),
                                       ("chosen", "chosen")], markdown=True), ""]
    lines += ["Each decision's predicted ms, score and kept mass per candidate are in the run's metrics.jsonl "
              "(`auto_decisions`).", ""]
    return lines


def network_caveats(network) -> list[str]:
    """What the report must say about a network that is not bandwidth-limited."""
    if network == "loopback":
        return ["**loopback is not bandwidth-limited**: the ranks exchange through this machine's memory, so "
                "the bytes saved by sparsification barely show in the step time and selection costs dominate; "
                "`--bandwidth 1gbit` (emulated cluster, root) or a real cluster shows what sending less is worth"]
    if network == "thread":
        return ["**thread ranks**: in-process, no network at all - step times say nothing about communication"]
    return []
