"""``sparsync run-default --workload gpt``: the transformer comparison at a link ratio r ~ 20, with its verdict.

The job is ``gpt-long`` (the ``gpt`` transformer under AdamW, 1200 steps, target held-out loss 1.3), 4
workers. At 100 Mbit/s a dense all-reduce of its 3.58M-parameter gradient takes about 20 times a step's
compute here (r ~ 20, a cross-datacenter ratio; ``docs/benchmarks.md`` says which clusters it stands for),
and one full run of DDP + fp16 at that rate would take about 20 minutes on its own. So every row runs twice:

1. **convergence** - to the end over loopback (real gloo processes; the same steps, seeds and data as on
   any network): steps to the target and the final held-out loss;
2. **time** - :data:`TIME_STEPS` steps on the emulated 100 Mbit/s cluster (one network namespace per
   rank, ``tc tbf``): the mean step on the slowest rank's clock, r and compute utilisation.

**Time to target = mean step time at 100 Mbit/s x steps to target** - an estimate, said so beside every
number. The rows (:data:`BASELINE_ROWS`, :data:`SPARSYNC_ROWS`): torch DDP with its fp16 hook, PowerSGD,
torch's post-local SGD, and sparsync's DiLoCo every 16 steps - dense, and with SparseLoCo's exchange (Sarfi et al. 2025:
top 64 of every 4096 entries, 2-bit values, error feedback decayed by 0.95; outer step the sum of the
ranks' sent parts). The
verdict (:func:`verdict`): the best sparsync row's estimated time to target at most :data:`GOAL_TIME` x
the best baseline's, at :data:`GOAL_UTIL` compute utilisation or more, its final loss within
:data:`GOAL_LOSS` of dense DiLoCo's at the same period.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WORKLOAD = "gpt-long"
#: rows sparsync did not add, each at its best setting on this job: torch DDP + fp16, PowerSGD rank 4 (rank 1
#: ends far above it), torch's post-local SGD at H = 16 (model averaging: the H with the least estimated time
#: to target at r ~ 20 - H = 8 reaches the target in 808 steps but pays twice the all-reduces, H = 32 does not
#: reach it in 1200 steps)
BASELINE_ROWS = ["ddp-fp16", "ddp-powersgd4", "ddp-localsgd16"]
#: sparsync's rows: DiLoCo every 16 steps, dense (plain averaging) and with SparseLoCo's exchange (its default
#: outer step under AdamW: the sum of the ranks' sent parts). At H = 8 SparseLoCo reaches the target sooner
#: but spends ~12 % of the time at 100 Mbit/s in its exchange; at 16 its final loss equals dense DiLoCo's
SPARSYNC_ROWS = ["dense,sync_every=16,outer_lr=1.0,outer_momentum=0.0",
                 "sparseloco:0.015625,sync_every=16,value_bits=2,ef_decay=0.95"]
#: the time pass: steps per row at 100 Mbit/s (two periods of the longest H, after a warm-up period)
TIME_STEPS = 48
RATE = "100mbit"
#: the goals: estimated time to target vs the best baseline, compute utilisation, final loss vs dense DiLoCo
GOAL_TIME, GOAL_UTIL, GOAL_LOSS = 0.5, 0.9, 0.015


def _compare_args(a, configs: str, name: str, network: str | None, steps: int | None) -> argparse.Namespace:
    return argparse.Namespace(
        workload=WORKLOAD, workers=a.workers, bandwidth=network, loopback=network is None, thread=False,
        steps=steps, epochs=None, batch_size=None, lr=None, optimizer=None, target_accuracy=None, eval_every=None,
        seed=0, workload_option=None, runs_dir=str(Path(a.runs_dir) / "make-run-gpt"), force=True,
        no_progress=a.no_progress, timeout=900.0, configs=configs, density=0.01, merge="single", no_baselines=True,
        name=name, ddp_option=None, repeats=1, seeds=1, resume=a.resume)


def run_gpt(a, network_reason: str | None) -> int:
    """Both passes, the merged table and the verdict; ``network_reason``: why the emulated network cannot be
    built (then the time pass runs over loopback and the verdict says it cannot judge r ~ 20). One writer:
    ``<runs-dir>/make-run-gpt`` stays locked (:class:`~sparsync.train.ownership.RunLock`) from the first
    pass until its report.md is written (whole, or not at all)."""
    import contextlib

    from ..train.ownership import RunLock

    root = Path(a.runs_dir) / "make-run-gpt"
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(RunLock(root, "comparison directory").acquire()):
        return _run_gpt(a, network_reason, root)


def _run_gpt(a, network_reason: str | None, root: Path) -> int:
    from ..train.ownership import atomic_write
    from .compare import compare

    configs = ";".join(BASELINE_ROWS + (a.sparse.split(";") if a.sparse else SPARSYNC_ROWS))
    print(f"transformer comparison ({WORKLOAD}, {a.workers} workers): convergence over loopback, then "
          f"{TIME_STEPS} steps per row at {RATE}", flush=True)
    compare(_compare_args(a, configs, "convergence", None, a.steps), title=f"{WORKLOAD}: convergence (loopback)")
    net = None if network_reason else RATE
    if network_reason:
        print(f"NOTE: the time pass runs over LOOPBACK ({network_reason}): no link ratio of ~20 here", flush=True)
    compare(_compare_args(a, configs, "time", net, TIME_STEPS), title=f"{WORKLOAD}: step times ({net or 'loopback'})")
    rows = merged(_runs(root / "convergence"), _runs(root / "time"))
    text = format_merged(rows, net or "loopback") + "\n\n" + verdict(rows, net is not None)
    print("\n" + text)
    atomic_write(root / "report.md", f"# make run: {WORKLOAD} at {net or 'loopback'}\n\n{text}\n\n"
                                     "Convergence: `convergence/report.md`; step times: `time/report.md`.\n")
    print(f"\nreport: {root / 'report.md'}")
    return 0


def _runs(d: Path) -> list[dict]:
    return json.loads((d / "comparison.json").read_text())["runs"]


def merged(converge: list[dict], timed: list[dict]) -> list[dict]:
    """One row per configuration: steps to target and final loss from the convergence pass, the mean step,
    r and utilisation from the time pass, and their product, the estimated time to target."""
    from ..train.rows import ratio_and_utilisation

    ru = ratio_and_utilisation(timed)
    step = {s["config"]: (s["train_time_s"] / (s.get("steps_run") or s["steps"]), *ru[id(s)]) for s in timed}
    out = []
    for s in sorted(converge, key=lambda s: s.get("config_index", 0)):
        mean_step, r, util = step.get(s["config"], (None, None, None))
        st = s.get("steps_to_target")
        out.append({"config": s["config"], "label": s["label"], "reducer": s["reducer"],
                    # the configurations run in order, the baselines first (a run's "config" is its run name)
                    "baseline": s.get("config_index", 0) < len(BASELINE_ROWS), "steps_to_target": st,
                    "final_loss": s.get("final_test_loss"), "mean_step_s": mean_step, "r": r, "util": util,
                    "bytes": s.get("mean_bytes_sent"),
                    "time_to_target_s": None if st is None or mean_step is None else st * mean_step})
    return out


def format_merged(rows: list[dict], network: str) -> str:
    from ..tables import format_table

    f = lambda v, fmt: "–" if v is None else fmt.format(v)
    table = [{"row": r["label"], "steps": f(r["steps_to_target"], "{:.0f}") if r["steps_to_target"] else "not reached",
              "loss": f(r["final_loss"], "{:.3f}"), "mb": f(r["bytes"] and r["bytes"] / 1e6, "{:.3f}"),
              "step": f(r["mean_step_s"] and 1e3 * r["mean_step_s"], "{:.0f}"), "r": f(r["r"], "{:.1f}"),
              "util": f(r["util"] and 100 * r["util"], "{:.0f} %"),
              "tt": f(r["time_to_target_s"], "{:.0f} s (estimate)")} for r in rows]
    cols = [("row", "row"), ("steps", "steps to target"), ("loss", "final loss"), ("mb", "MB sent/step (mean)"),
            ("step", f"mean step ms ({network})"), ("r", "r"), ("util", "compute util"),
            ("tt", "time to target = step x steps")]
    return format_table(table, cols, markdown=True)


def verdict(rows: list[dict], at_rate: bool) -> str:
    """The goals of the module docstring on :func:`merged`'s rows."""
    if not at_rate:
        return "goal: cannot judge at r ~ 20 (the time pass ran over loopback)"
    base = [r for r in rows if r["baseline"] and r["time_to_target_s"] is not None]
    ours = [r for r in rows if not r["baseline"] and r["time_to_target_s"] is not None]
    if not base or not ours:
        return "goal NOT met: " + ("no baseline reached the target" if not base else "no sparsync row reached it")
    b = min(base, key=lambda r: r["time_to_target_s"])
    o = min(ours, key=lambda r: r["time_to_target_s"])
    dense = next((r for r in rows if r["reducer"] == "diloco-dense"), None)
    checks = [(o["time_to_target_s"] <= GOAL_TIME * b["time_to_target_s"],
               f"time to target {o['time_to_target_s'] / b['time_to_target_s']:.2f}x {b['label']}'s (estimates; "
               f"goal <= {GOAL_TIME:g})"),
              (o["util"] is not None and o["util"] >= GOAL_UTIL,
               f"compute utilisation {100 * (o['util'] or 0):.0f} % (goal >= {100 * GOAL_UTIL:.0f} %)")]
    if dense is not None and dense is not o and dense["final_loss"] and o["final_loss"]:
        gap = o["final_loss"] / dense["final_loss"] - 1
        checks.append((gap <= GOAL_LOSS, f"final loss {100 * gap:+.1f} % against dense DiLoCo's (goal <= "
                                         f"{100 * GOAL_LOSS:.1f} %)"))
    ok = all(c for c, _ in checks)
    lines = [f"goal {'MET' if ok else 'NOT met'}: best sparsync row {o['label']}"]
    lines += [f"  [{'ok' if c else 'NO'}] {m}" for c, m in checks]
    return "\n".join(lines)
