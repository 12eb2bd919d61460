"""The comparison's PNG plots (matplotlib; the caller selects the Agg backend): accuracy and loss
against training wall-clock, time to target, the step breakdown, bytes and density per step - what
each shows is listed in :mod:`sparsync.train.report`. A row keeps its colour, line style and marker
in every plot; with several runs a row is the median of their curves with their range as a band."""

from __future__ import annotations

import math
from pathlib import Path

from .rows import _is_baseline, aggregate

__all__ = ["LOG_SPAN"]

_STYLES = ["-", "--", "-.", ":"]
_MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]


def _style(i: int, n_points: int) -> dict:
    """A distinct (line style, marker, width) per row so that equal curves do not hide each other; the
    same colour and marker for the same row in every plot."""
    return {"color": f"C{i % 10}", "ls": _STYLES[i % len(_STYLES)], "marker": _MARKERS[i % len(_MARKERS)], "ms": 4,
            "markevery": max(1, n_points // 8), "lw": max(0.8, 2.4 - 0.2 * i)}


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
    _save(fig, out_dir / "time_to_target.png", dpi=110)
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
    _save(fig, out_dir / "step_breakdown.png", dpi=110, bbox_inches="tight")
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
        _save(fig, out_dir / fname, dpi=110, bbox_inches="tight")
        plt.close(fig)


def _legend_outside(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)



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
    _save(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _save(fig, path, **kw) -> None:
    """``fig.savefig(path)``; a failed write (a full disk) raises an OSError naming ``path``."""
    from .ownership import named_errors

    with named_errors(path):
        fig.savefig(path, **kw)
