"""Reports of several runs side by side: ``report.md`` + PNG plots (matplotlib, Agg backend).

Input: run directories written by :mod:`sparsync.train.loop` (``summary.json``, ``metrics.jsonl``).
Output, in the comparison directory:

* ``accuracy_vs_time.png``  held-out accuracy against training wall-clock (evaluation excluded);
* ``loss_vs_time.png``      training loss (rank 0, moving average over 5 steps) against wall-clock;
* ``step_breakdown.png``    median time per step: the main thread's compute (forward + backward
  compute + optimizer) and wait (reduction not hidden behind backward), next to the reducers' own
  selection and communication time (which may overlap backward); torch DDP has no split (its
  all-reduce runs inside backward), shown as one bar;
* ``bytes_per_step.png``    median bytes sent per rank per step (log scale);
* ``density.png``           achieved density (entries transmitted / entries) per step of the sparse
  runs (dense and torch DDP send everything: a density of 1 by definition, left out so they do not
  hide the scale);
* ``report.md``             the table (median and mean step - the mean counts the rare synchronising
  steps of local-step rows, which the median hides -, split, MB/step, density, time to target
  accuracy, final accuracy, speed-up over dense: in time to target, or — when this run or dense
  did not reach the target — in median step time, marked "step") and the plots.

Lines that coincide (dense SparseDDP and torch DDP send the same bytes) stay visible: every run
gets its own line style and marker, drawn thinner the later it comes.
The same runs as data: ``comparison.csv`` / ``comparison.json`` (:mod:`sparsync.train.records`).

Time to target = training wall-clock at the first evaluation whose accuracy reaches the target.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..tables import format_table as _format_table

__all__ = ["format_table", "table_rows", "write_report"]

_STYLES = ["-", "--", "-.", ":"]
_MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]


def _style(i: int, n_points: int) -> dict:
    """A distinct (line style, marker, width) per run so that equal curves do not hide each other; the
    same colour and marker for the same run in every plot."""
    return {"color": f"C{i % 10}", "ls": _STYLES[i % len(_STYLES)], "marker": _MARKERS[i % len(_MARKERS)], "ms": 4,
            "markevery": max(1, n_points // 8), "lw": max(0.8, 2.4 - 0.3 * i)}


def _is_baseline(s: dict) -> bool:
    return s.get("reducer") in ("dense", "ddp", "ddp-fp16")


def _load(run_dir: Path) -> tuple[dict, list[dict]]:
    s = json.loads((run_dir / "summary.json").read_text())
    from .runs import read_metrics

    m = read_metrics(run_dir / "metrics.jsonl")  # a torn last line: dropped, with a warning
    return s, m


def _ms(v):
    return "–" if v is None else f"{1e3 * v:.1f}"


def table_rows(summaries: list[dict]) -> list[dict]:
    """One row per run; ``vs_dense`` = dense SparseDDP time-to-target / this run's, or, when either
    did not reach the target, dense's median step time / this run's (marked ``step``)."""
    from .records import add_speedups

    floor = next((s.get("median_step_s") for s in summaries if s["reducer"] == "nocomm"), None)
    rows = []
    for s in add_speedups([dict(x) for x in summaries]):
        tt = s.get("time_to_target_s")
        if s["speedup_time_to_target"] is not None:
            vs = f"{s['speedup_time_to_target']:.2f}x"
        elif s["speedup_step"] is not None:
            vs = f"{s['speedup_step']:.2f}x step"
        else:
            vs = "–"
        rows.append({
            "config": s["label"], "name": s["name"],
            "step_ms": _ms(s.get("median_step_s")), "step_mean_ms": _ms(s.get("mean_step_s")),
            "compute_ms": _ms(s.get("median_compute_s")),
            "x_floor": "–" if not floor or s.get("median_step_s") is None else f"{s['median_step_s'] / floor:.2f}",
            "select_ms": _ms(s.get("median_select_s")), "comm_ms": _ms(s.get("median_comm_s")),
            "select_mean_ms": _ms(_max_rank(s, "mean_select_s") or s.get("mean_select_s")),
            "wait_ms": _ms(s.get("median_wait_s")),
            "mb_step": "–" if s.get("median_bytes_sent") is None else f"{s['median_bytes_sent'] / 1e6:.3f}",
            "mb_step_mean": "–" if s.get("mean_bytes_sent") is None else f"{s['mean_bytes_sent'] / 1e6:.3f}",
            "density": "–" if s.get("median_density") is None else f"{s['median_density']:.4f}",
            "time_to_target": "not reached" if tt is None else f"{tt:.2f} s",
            "final_acc": "–" if s.get("final_accuracy") is None else f"{100 * s['final_accuracy']:.2f} %",
            "vs_dense": vs,
        })
    return rows


_COLS = [("config", "configuration"), ("step_ms", "step ms"), ("step_mean_ms", "step ms (mean)"),
         ("x_floor", "x floor"), ("compute_ms", "compute ms"),
         ("select_ms", "select ms"), ("select_mean_ms", "select ms (mean, slowest rank)"),
         ("comm_ms", "comm ms"), ("wait_ms", "wait ms"), ("mb_step", "MB sent/step"),
         ("mb_step_mean", "MB sent/step (mean)"),
         ("density", "density"), ("time_to_target", "time to target"), ("final_acc", "final acc"),
         ("vs_dense", "speed-up vs dense")]


def format_table(rows: list[dict], markdown: bool = True) -> str:
    """The comparison table (columns :data:`_COLS`), Markdown or aligned text."""
    return _format_table(rows, _COLS, markdown=markdown, first_left=True)


def write_report(out_dir: str | Path, run_dirs: list[str | Path], title: str, notes: list[str] | None = None) -> Path:
    """Write plots and report.md into ``out_dir``; returns the report path."""
    from ..extras import require

    require("matplotlib", "plots", "the comparison report").use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [_load(Path(d)) for d in run_dirs]
    summaries = [s for s, _ in runs]
    target = summaries[0].get("target_accuracy") if summaries else None

    # accuracy vs wall-clock
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (s, m) in enumerate(runs):
        ev = [r for r in m if "accuracy" in r]
        ax.plot([r["time_s"] for r in ev], [r["accuracy"] for r in ev], label=s["label"], **_style(i, len(ev)))
    if target:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
    _finish_time_plot(fig, ax, "held-out accuracy", title, out_dir / "accuracy_vs_time.png")

    # training loss vs wall-clock (moving average: single steps are noisy)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (s, m) in enumerate(runs):
        pts = [(r["time_s"], r["loss"]) for r in m if _finite(r.get("loss")) and _finite(r.get("time_s"))]
        k = 5
        smooth = [sum(p[1] for p in pts[max(0, j - k + 1):j + 1]) / len(pts[max(0, j - k + 1):j + 1])
                  for j in range(len(pts))]
        if pts:
            ax.plot([p[0] for p in pts], smooth, label=s["label"], **_style(i, len(pts)))
    ax.set_yscale("log")
    _finish_time_plot(fig, ax, "training loss (rank 0, mean of the last 5 steps)", title, out_dir / "loss_vs_time.png")

    _plot_step_breakdown_and_per_step(plt, runs, summaries, out_dir)

    s0 = summaries[0] if summaries else {}
    lines = [f"# {title}", ""]
    lines += [(f"- workload `{s0.get('workload')}`, {s0.get('workers')} workers, network `{s0.get('network')}`, "
               f"{s0.get('steps')} steps, target accuracy {target}"), ""]
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
               "`x floor` = step time / the no-communication floor's (same model and data, gradients not "
               "exchanged; its accuracy is rank 0's local model). "
               "`speed-up vs dense` is in time to target; `step` marks the median step-time ratio, shown when "
               "this run or dense did not reach the target. The same numbers as data: `comparison.csv`, "
               "`comparison.json`."), ""]
    for f, cap in (("accuracy_vs_time.png", "accuracy vs wall-clock"), ("loss_vs_time.png", "loss vs wall-clock"),
                   ("step_breakdown.png", "time per step"),
                   ("bytes_per_step.png", "bytes per step"), ("density.png", "achieved density")):
        lines += [f"![{cap}]({f})", ""]
    lines += ["Runs: " + ", ".join(f"`{Path(d)}`" for d in run_dirs), ""]
    p = out_dir / "report.md"
    p.write_text("\n".join(lines))
    return p


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


def _plot_step_breakdown_and_per_step(plt, runs, summaries, out_dir: Path) -> None:
    """step_breakdown.png (main thread vs reducer work per configuration), bytes_per_step.png and
    density.png (per step)."""
    # step breakdown: left bar = main thread (compute + wait), right bar = reducer work (select + comm)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [s["label"] for s in summaries]
    xs = list(range(len(summaries)))
    w = 0.38
    ms = lambda s, k: 1e3 * (s.get(k) or 0.0)
    comp = [ms(s, "median_compute_s") for s in summaries]
    wait = [ms(s, "median_wait_s") for s in summaries]
    sel = [ms(s, "median_select_s") for s in summaries]
    com = [ms(s, "median_comm_s") for s in summaries]
    ddp = [ms(s, "median_step_s") if s.get("median_compute_s") is None else 0.0 for s in summaries]
    left = [x - w / 2 for x in xs]
    right = [x + w / 2 for x in xs]
    ax.bar(left, comp, w, label="compute (fwd + bwd + optimizer)", color="tab:blue")
    ax.bar(left, wait, w, bottom=comp, label="wait for reduction (not hidden)", color="tab:red")
    ax.bar(left, ddp, w, color="lightgrey", label="torch DDP step (no split)")
    ax.bar(right, sel, w, label="reducer: select", color="tab:orange")
    ax.bar(right, com, w, bottom=sel, label="reducer: comm", color="tab:green")
    ax.scatter(left, [ms(s, "median_step_s") for s in summaries], color="black", marker="_", s=300, zorder=3,
               label="measured step")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (median)")
    ax.set_title("time per step: main thread (left) and reducer work (right, may overlap backward)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "step_breakdown.png", dpi=110)
    plt.close(fig)

    # bytes per step / density per step
    for key, fname, ylabel, logy in (("bytes_sent", "bytes_per_step.png", "bytes sent per rank per step", True),
                                     ("density", "density.png", "achieved density", True)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        drawn = []
        for i, (s, m) in enumerate(runs):
            if key == "density" and _is_baseline(s):
                continue  # density 1 by definition; drawn, it squeezes the sparse runs into the bottom
            pts = [(r["step"], r[key]) for r in m if isinstance(r.get(key), (int, float)) and r[key] > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=s["label"], **_style(i, len(pts)))
                drawn += [p[1] for p in pts]
        if key == "density" and any(_is_baseline(s) for s in summaries):
            ax.set_title("dense and torch DDP send every entry (density 1; not drawn)", fontsize=9)
        if logy and drawn and max(drawn) > LOG_SPAN * min(drawn):  # a narrow range on a log axis: unreadable ticks
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)


def _max_rank(s: dict, key: str):
    vals = [r.get(key) for r in s.get("per_rank") or [] if r.get(key) is not None]
    return max(vals) if vals else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _finish_time_plot(fig, ax, ylabel: str, title: str, path) -> None:
    """Label, save and close a metric-vs-training-wall-clock plot (accuracy and loss share it)."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("training wall-clock (s, evaluation excluded)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
