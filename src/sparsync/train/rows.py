"""One row per configuration of a comparison: its short name (:func:`short_label`, made unique by
:func:`short_labels`) and its numbers over the runs (:func:`aggregate`: medians with 95 % bootstrap
intervals, :mod:`sparsync.train.stats`; ``x floor`` against the round's floor, :func:`floors`;
ratios to another row taken within each round, :func:`ratio_to`). Tables and plots of
:mod:`sparsync.train.report` and :mod:`sparsync.train.plots` read these rows."""

from __future__ import annotations

import math

from .stats import interval, paired_ratios

__all__ = ["aggregate", "floors", "ratio_to", "short_label", "short_labels"]

_TORCH_SHORT = {"ddp": "DDP", "ddp-fp16": "DDP fp16", "nocomm": "no-comm floor"}
#: convergence / reducer options with a short tag in the plots' names (others: "+opts")
_TAGS = {"momentum": "mc", "warmup_steps": "wu", "delay": "delay"}


def _is_baseline(s: dict) -> bool:
    return s.get("reducer") in ("dense", "ddp", "ddp-fp16")


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


def compute_per_step(summaries: list[dict]) -> dict:
    """Run (by ``id``) -> its compute seconds per step: its own median where the run splits it out, else
    (torch DDP rows, whose backward overlaps the exchange) the median of its round's measured ones."""
    import statistics as stt

    by_round: dict = {}
    for s in summaries:
        if s.get("median_compute_s"):
            by_round.setdefault(_round(s), []).append(s["median_compute_s"])
    return {id(s): s.get("median_compute_s") or (stt.median(by_round[_round(s)]) if by_round.get(_round(s)) else None)
            for s in summaries}


def ratio_and_utilisation(summaries: list[dict]) -> dict:
    """Run (by ``id``) -> ``(r, utilisation)``: the link ratio (a dense all-reduce's time over the
    compute per step, :func:`compute_per_step`) and compute per step over the run's mean step time
    (its clock, the slowest rank's, over the steps it ran); ``None`` where a part is unknown."""
    from .clock import link_ratio, utilisation

    comp = compute_per_step(summaries)
    out = {}
    for s in summaries:
        c, steps = comp[id(s)], s.get("steps_run") or s.get("steps")
        mean_step = s["train_time_s"] / steps if s.get("train_time_s") and steps else None
        out[id(s)] = (link_ratio(s.get("allreduce_s"), c), utilisation(c, mean_step))
    return out


def aggregate(summaries: list[dict]) -> list[dict]:
    """One entry per configuration (order of first appearance): its runs and, for each quantity, an
    :class:`~sparsync.train.stats.Interval` over the runs (``None`` when no run has it): ``step_s``,
    ``compute_s``, ``select_s``, ``comm_s``, ``wait_s``, ``mean_select_s`` (slowest rank),
    ``bytes``, ``density``, ``time_to_target_s``, ``steps_to_target`` (``inf`` = not reached),
    ``final_accuracy``, ``x_floor`` (step / its round's floor), ``link_ratio`` and ``utilisation``
    (:func:`ratio_and_utilisation`), and ``speedup`` with ``speedup_kind``:
    dense SparseDDP's time to target / this row's within each round, or - when some round of either
    did not reach the target - the same ratio of median step times (``"step"``)."""
    fl = floors(summaries)
    names = short_labels(summaries)
    ru = ratio_and_utilisation(summaries)
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
               "link_ratio": _iv([ru[id(r)][0] for r in runs]), "utilisation": _iv([ru[id(r)][1] for r in runs]),
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


def _max_rank(s: dict, key: str):
    vals = [r.get(key) for r in s.get("per_rank") or [] if r.get(key) is not None]
    return max(vals) if vals else None
