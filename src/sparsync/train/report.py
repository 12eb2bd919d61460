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
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..tables import format_table as _format_table
from .stats import interval, paired_ratios

__all__ = ["aggregate", "floors", "format_table", "short_labels", "table_rows", "write_report"]

_STYLES = ["-", "--", "-.", ":"]
_MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]
_TORCH_SHORT = {"ddp": "DDP", "ddp-fp16": "DDP fp16", "nocomm": "no-comm floor"}
#: convergence / reducer options with a short tag in the plots' names (others: "+opts")
_TAGS = {"momentum": "mc", "warmup_steps": "wu", "delay": "delay"}


def _style(i: int, n_points: int) -> dict:
    """A distinct (line style, marker, width) per row so that equal curves do not hide each other; the
    same colour and marker for the same row in every plot."""
    return {"color": f"C{i % 10}", "ls": _STYLES[i % len(_STYLES)], "marker": _MARKERS[i % len(_MARKERS)], "ms": 4,
            "markevery": max(1, n_points // 8), "lw": max(0.8, 2.4 - 0.2 * i)}


def _is_baseline(s: dict) -> bool:
    return s.get("reducer") in ("dense", "ddp", "ddp-fp16")


def _load(run_dir: Path) -> tuple[dict, list[dict]]:
    s = json.loads((run_dir / "summary.json").read_text())
    cf = run_dir / "config.json"
    if cf.exists() and "reducer_options" not in s:
        c = json.loads(cf.read_text())
        s = {**s, "reducer_options": c.get("reducer_options") or {}, "ddp_options": c.get("ddp_options") or {}}
    from .runs import read_metrics

    m = read_metrics(run_dir / "metrics.jsonl")  # a torn last line: dropped, with a warning
    return s, m


def _round(s: dict):
    return s.get("round", 0)


def _key(s: dict) -> str:
    return s.get("config") or s.get("name") or s.get("label")


# ---------------------------------------------------------------------------------------------- labels
def short_label(s: dict) -> str:
    """A plot-sized name: ``DDP fp16``, ``PowerSGD r1``, ``dense``, ``micro 2% +mc+wu+fp16``."""
    r = s.get("reducer", "?")
    if r in _TORCH_SHORT:
        return _TORCH_SHORT[r]
    if r.startswith("ddp-powersgd"):
        return f"PowerSGD r{r.removeprefix('ddp-powersgd')}"
    if r.startswith("ddp-"):
        return r
    name = r if r == "dense" or s.get("density") is None else f"{r} {100 * float(s['density']):g}%"
    opts = {**(s.get("convergence") or {}), **(s.get("reducer_options") or {}), **(s.get("ddp_options") or {})}
    tags = []
    for k, v in opts.items():
        if k in _TAGS and v:
            tags.append(_TAGS[k])
        elif k == "value_dtype":
            tags.append(str(v))
        elif k not in ("masking", "nesterov", "warmup_start") and "opts" not in tags:
            tags.append("opts")
    if s.get("merge") not in (None, "single"):
        tags.append(str(s["merge"]))
    return name + ("".join(f" +{t}" if i == 0 else f"+{t}" for i, t in enumerate(tags)))


def short_labels(summaries: list[dict]) -> dict:
    """Configuration key -> short label, made unique (``(2)``, ``(3)`` ... on repeats of a name)."""
    out, used = {}, {}
    for s in summaries:
        k = _key(s)
        if k in out:
            continue
        base = short_label(s)
        used[base] = used.get(base, 0) + 1
        out[k] = base if used[base] == 1 else f"{base} ({used[base]})"
    return out


# ---------------------------------------------------------------------------------------------- numbers
def floors(summaries: list[dict]) -> dict:
    """Round -> the floor (seconds per step): the least compute time per step of any run of that
    round; a run without a compute split (torch DDP, the no-communication row) counts with its step.
    ``min(compute, step)`` per run, so every run's step is at or above its round's floor."""
    out = {}
    for s in summaries:
        step, comp = s.get("median_step_s"), s.get("median_compute_s")
        cands = [v for v in (step, comp) if v is not None and v > 0]
        if cands:
            out[_round(s)] = min(out.get(_round(s), math.inf), *cands)
    return out


def aggregate(summaries: list[dict]) -> list[dict]:
    """One entry per configuration (order of first appearance): its runs and, for each quantity, an
    :class:`~sparsync.train.stats.Interval` over the runs (``None`` when no run has it): ``step_s``,
    ``compute_s``, ``select_s``, ``comm_s``, ``wait_s``, ``mean_select_s`` (slowest rank),
    ``bytes``, ``density``, ``time_to_target_s``, ``steps_to_target`` (``inf`` = not reached),
    ``final_accuracy``, ``x_floor`` (step / its round's floor), and ``speedup`` with ``speedup_kind``:
    dense SparseDDP's time to target / this row's within each round, or - when some round of either
    did not reach the target - the same ratio of median step times (``"step"``)."""
    fl = floors(summaries)
    names = short_labels(summaries)
    groups: dict = {}
    for s in sorted(summaries, key=lambda s: s.get("config_index", 0)):  # the order compare ran them in
        groups.setdefault(_key(s), []).append(s)
    dense = next((g for g in groups.values() if g[0].get("reducer") == "dense"), None)
    out = []
    for k, runs in groups.items():
        iv = lambda key, runs=runs: _iv([r.get(key) for r in runs])
        row = {"config": k, "label": runs[0].get("label", k), "short": names[k], "reducer": runs[0].get("reducer"),
               "runs": runs, "n": len(runs),
               "step_s": iv("median_step_s"), "compute_s": iv("median_compute_s"), "select_s": iv("median_select_s"),
               "comm_s": iv("median_comm_s"), "wait_s": iv("median_wait_s"),
               "mean_select_s": _iv([_max_rank(r, "mean_select_s") or r.get("mean_select_s") for r in runs]),
               "bytes": iv("median_bytes_sent"), "density": iv("median_density"),
               "mean_step_s": iv("mean_step_s"), "mean_bytes": iv("mean_bytes_sent"),
               "time_to_target_s": interval([r.get("time_to_target_s") for r in runs]),
               "steps_to_target": interval([r.get("steps_to_target") if r.get("time_to_target_s") is not None
                                            else None for r in runs]),
               "final_accuracy": iv("final_accuracy"),
               "x_floor": interval([r["median_step_s"] / fl[_round(r)] for r in runs
                                    if r.get("median_step_s") and fl.get(_round(r))]) if fl else None,
               "speedup": None, "speedup_kind": None}
        if row["x_floor"] is not None and row["x_floor"].n == 0:
            row["x_floor"] = None
        if dense is not None:
            by = lambda rs, key: {_round(r): r.get(key) for r in rs}
            tt_ok = all(r.get("time_to_target_s") for r in runs + dense)
            key = "time_to_target_s" if tt_ok else "median_step_s"
            ratios = paired_ratios(by(dense, key), by(runs, key))  # dense / this row: > 1 = faster than dense
            if ratios:
                row["speedup"], row["speedup_kind"] = interval(ratios), ("time" if tt_ok else "step")
        out.append(row)
    return out


def _iv(values):
    """Interval of the values that exist (``None`` = not measured, not "not reached"); ``None`` if none."""
    v = [x for x in values if x is not None]
    return interval(v) if v else None


def ratio_to(row: dict, base: dict | None, key: str = "time_to_target_s"):
    """Interval of ``row / base`` (two :func:`aggregate` entries) over the rounds both ran (``key`` of
    each run; not reached = inf); ``None`` without a baseline or a common round."""
    if base is None:
        return None
    by = lambda a: {_round(r): r.get(key) for r in a["runs"]}
    return interval(paired_ratios(by(row), by(base)))


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
            "vs_dense": "–" if sp is None else _fmt(sp, lambda x: f"{x:.2f}x", inf="inf") +
            (" step" if a["speedup_kind"] == "step" else ""),
        })
    return rows


_COLS = [("short", "row"), ("step_ms", "step ms"), ("step_mean_ms", "step ms (mean)"), ("x_floor", "x floor"),
         ("compute_ms", "compute ms"), ("select_ms", "select ms"), ("select_mean_ms", "select ms (mean, slowest rank)"),
         ("comm_ms", "comm ms"), ("wait_ms", "wait ms"), ("mb_step", "MB sent/step"),
         ("mb_step_mean", "MB sent/step (mean)"), ("density", "density"), ("steps_to_target", "steps to target"),
         ("time_to_target", "time to target"), ("final_acc", "final acc"), ("vs_dense", "speed-up vs dense"),
         ("n", "runs"), ("config", "configuration")]


#: the terminal's table: the columns a verdict reads, then which row is which configuration
_TERMINAL = ("short", "step_ms", "x_floor", "compute_ms", "wait_ms", "mb_step", "steps_to_target", "time_to_target",
             "final_acc", "vs_dense", "n")


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


#: bytes/density plots use a log axis only when the values span more than this factor
LOG_SPAN = 10.0


def _band(plt_ax, xs, lo, hi, color) -> None:
    plt_ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)


def _median_curve(series: list[list[tuple[float, float]]]):
    """Runs' curves (lists of (x, y) at the same positions) -> (x median, y median, y low, y high) at
    each position the shortest curve has; the band is the lowest to highest run."""
    from .stats import median

    n = min(len(c) for c in series)
    xs = [median([c[j][0] for c in series]) for j in range(n)]
    ys = [[c[j][1] for c in series] for j in range(n)]
    return xs, [median(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def _draw_rows(ax, agg, curve_of, skip=lambda a: False) -> list[float]:
    """One line per row (the median of its runs' curves ``curve_of(summary)``; its own colour, style
    and marker) and, with several runs, their range as a band. Returns every y value drawn."""
    drawn = []
    for i, a in enumerate(agg):
        series = [c for c in (curve_of(s) for s in a["runs"]) if c]
        if skip(a) or not series:
            continue
        xs, ys, lo, hi = _median_curve(series)
        st = _style(i, len(xs))
        ax.plot(xs, ys, label=a["short"], **st)
        if len(series) > 1:
            _band(ax, xs, lo, hi, st["color"])
        drawn += [y for c in series for _, y in c]
    return drawn


def _plot_curves(plt, agg, metrics, title, target, metric, out_dir: Path) -> None:
    """accuracy_vs_time.png and loss_vs_time.png: the median over a row's runs, their range as a band."""
    fig, ax = plt.subplots(figsize=(9, 4.8))
    _draw_rows(ax, agg, lambda s: [(r["time_s"], r["accuracy"]) for r in metrics[id(s)] if "accuracy" in r])
    if target and metric == "accuracy":
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
        ax.set_ylim(max(0.0, target - 0.15), 1.0)  # where the rows cross the target (the early climb is cut)
    _finish_time_plot(fig, ax, "held-out accuracy", title, out_dir / "accuracy_vs_time.png")

    def smoothed_loss(s):
        pts = [(r["time_s"], r["loss"]) for r in metrics[id(s)] if _finite(r.get("loss")) and _finite(r.get("time_s"))]
        win = [pts[max(0, j - 4):j + 1] for j in range(len(pts))]  # the last 5 steps
        return [(p[0], sum(q[1] for q in w) / len(w)) for p, w in zip(pts, win)]

    fig, ax = plt.subplots(figsize=(9, 4.8))
    _draw_rows(ax, agg, smoothed_loss)
    ax.set_yscale("log")
    _finish_time_plot(fig, ax, "training loss (rank 0, mean of the last 5 steps)", title, out_dir / "loss_vs_time.png")


def _plot_time_to_target(plt, agg, title, out_dir: Path) -> None:
    """time_to_target.png: every run as a dot, the median as a tick, its interval as a bar; rows
    that never reached the target are written as such."""
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(agg) + 1.6))
    ys = list(range(len(agg)))[::-1]
    for y, (i, a) in zip(ys, enumerate(agg)):
        iv = a["time_to_target_s"]
        col = f"C{i % 10}"
        pts = [r["time_to_target_s"] for r in a["runs"] if r.get("time_to_target_s") is not None]
        ax.scatter(pts, [y] * len(pts), color=col, s=18, zorder=3)
        if iv is not None and math.isfinite(iv.mid):
            hi = iv.hi if math.isfinite(iv.hi) else max(pts)
            ax.plot([iv.lo, hi], [y, y], color=col, lw=5, alpha=0.35, solid_capstyle="butt")
            ax.plot([iv.mid], [y], color="black", marker="|", ms=14)
        if len(pts) < len(a["runs"]):
            ax.annotate(f"{len(a['runs']) - len(pts)} of {len(a['runs'])} not reached", (0, y), xytext=(4, 4),
                        textcoords="offset points", fontsize=7, xycoords=("axes fraction", "data"))
    ax.set_yticks(ys)
    ax.set_yticklabels([a["short"] for a in agg], fontsize=8)
    ax.set_xlabel("training wall-clock to the target (s): runs (dots), median (|), 95 % interval (bar)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out_dir / "time_to_target.png", dpi=110)
    plt.close(fig)


def _plot_step_breakdown_and_per_step(plt, runs, summaries, out_dir: Path) -> None:
    """step_breakdown.png (main thread vs reducer work per configuration, medians over the runs, the
    measured step's interval as an error bar), bytes_per_step.png and density.png (per step).
    ``runs``: (summary, metrics) pairs; ``summaries``: the same summaries."""
    agg = aggregate(summaries)
    metrics = {id(s): m for s, m in runs}
    fig, ax = plt.subplots(figsize=(10, 4.8))
    xs = list(range(len(agg)))
    w = 0.38
    ms = lambda a, k: 1e3 * (a[k].mid if a.get(k) is not None else 0.0)
    comp = [ms(a, "compute_s") for a in agg]
    wait = [ms(a, "wait_s") for a in agg]
    sel = [ms(a, "select_s") for a in agg]
    com = [ms(a, "comm_s") for a in agg]
    ddp = [ms(a, "step_s") if a.get("compute_s") is None else 0.0 for a in agg]
    left = [x - w / 2 for x in xs]
    right = [x + w / 2 for x in xs]
    ax.bar(left, comp, w, label="compute (fwd + bwd + optimizer)", color="tab:blue")
    ax.bar(left, wait, w, bottom=comp, label="wait for reduction (not hidden)", color="tab:red")
    ax.bar(left, ddp, w, color="lightgrey", label="step without a split (torch DDP, floor)")
    ax.bar(right, sel, w, label="reducer: select", color="tab:orange")
    ax.bar(right, com, w, bottom=sel, label="reducer: comm", color="tab:green")
    step = [a["step_s"] for a in agg]
    mid = [1e3 * s.mid if s else 0.0 for s in step]
    err = [[1e3 * (s.mid - s.lo) if s else 0.0 for s in step], [1e3 * (s.hi - s.mid) if s else 0.0 for s in step]]
    ax.errorbar(left, mid, yerr=err, fmt="_", color="black", ms=18, capsize=3, zorder=3,
                label="measured step (median, interval)")
    ax.set_xticks(xs)
    ax.set_xticklabels([a["short"] for a in agg], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (median)")
    ax.set_title("time per step: main thread (left) and reducer work (right, may overlap backward)", fontsize=9)
    _legend_outside(ax)
    fig.tight_layout()
    fig.savefig(out_dir / "step_breakdown.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    for key, fname, ylabel in (("bytes_sent", "bytes_per_step.png", "bytes sent per rank per step"),
                               ("density", "density.png", "achieved density")):
        fig, ax = plt.subplots(figsize=(9, 4.8))
        # density 1 by definition for dense and torch DDP; drawn, it squeezes the sparse runs into the bottom
        skip = (lambda a: _is_baseline(a["runs"][0])) if key == "density" else (lambda a: False)
        drawn = _draw_rows(ax, agg, lambda s, key=key: [(r["step"], r[key]) for r in metrics[id(s)]
                                                        if isinstance(r.get(key), (int, float)) and r[key] > 0], skip)
        if key == "density" and any(_is_baseline(a["runs"][0]) for a in agg):
            ax.set_title("dense and torch DDP send every entry (density 1; not drawn)", fontsize=9)
        if drawn and max(drawn) > LOG_SPAN * min(drawn):  # a narrow range on a log axis: unreadable ticks
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            _legend_outside(ax)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110, bbox_inches="tight")
        plt.close(fig)


def _legend_outside(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _max_rank(s: dict, key: str):
    vals = [r.get(key) for r in s.get("per_rank") or [] if r.get(key) is not None]
    return max(vals) if vals else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _finish_time_plot(fig, ax, ylabel: str, title: str, path) -> None:
    """Label, save and close a metric-vs-training-wall-clock plot (accuracy and loss share it)."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("training wall-clock (s, evaluation excluded); band: lowest to highest run")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        _legend_outside(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
