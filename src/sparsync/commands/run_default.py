"""``sparsync run-default`` (what ``make run`` calls): the default comparison, about five minutes.

digits wide MLP (64-2048-2048-10, 4.35M parameters), 4 workers, on the emulated 1 Gbit/s cluster
when this process may build one (root + iproute2), otherwise over loopback — said clearly, because
on loopback the wire is ~40x faster and sparse methods have little to win. Configurations (100 steps
each): the **no-communication floor** (same model and data, gradients never exchanged: the limit of
this machine; every step time is divided by it, column ``x floor``), dense SparseDDP, what a user
would pick instead — torch DDP plain, with its fp16 compression hook, with its PowerSGD hook at rank 1
and 4 (torch's own ``PowerSGDState``, error feedback and warm start) — and the default sparse
configurations (:data:`DEFAULT_SPARSE`: reducer, density, convergence options of
:mod:`sparsync.convergence`, merge plan). Ends with the table, the verdict on issue 10's goal
(:func:`verdict`) and the report's path. ``--workers`` and ``--workload lm`` give the other tables of
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import sys

#: the sparse configurations ``make run`` shows, best first (``sparsync compare --configs`` syntax):
#: chosen by the steps-to-target and make-run measurements in docs/benchmarks.md ("make run")
#: (fp16 values: half the bytes, neutral at 1 Gbit/s on this CPU-bound machine, 15-17 % faster steps at 200 Mbit/s)
#: (momentum correction takes the rows' kind of momentum: Nesterov's with OPTIMIZER, the label says so)
DEFAULT_SPARSE = ["micro:0.02,momentum=0.9,masking=false,warmup_steps=20,warmup_start=0.05,value_dtype=fp16",
                  "micro:0.01,momentum=0.9,masking=false,warmup_steps=20,warmup_start=0.05,value_dtype=fp16",
                  "micro:0.01"]
#: the optimizer of every row of the digits table (torch DDP's included; other workloads keep their
#: own): SGD with Nesterov momentum 0.9. It reaches the
#: target in fewer steps than plain momentum for dense and sparse training alike (digits MLP, 4 workers,
#: evaluation every step: dense 38 -> 35, micro 2 % + momentum correction 43 -> 39; docs/benchmarks.md)
OPTIMIZER = "nesterov"
#: torch DDP baselines in make run's table
TORCH_ROWS = ["ddp", "ddp-fp16", "ddp-powersgd1", "ddp-powersgd4"]


def register(sub) -> None:
    p = sub.add_parser("run-default", help="the default comparison `make run` shows (about five minutes)")
    from . import WORKERS

    p.add_argument("--steps", type=WORKERS, default=None, help="steps per configuration (default 100; lm: its own)")
    p.add_argument("--workers", type=WORKERS, default=4, help="ranks (processes)")
    p.add_argument("--workload", default="digits-mlp", help="digits-mlp (default) or lm")
    p.add_argument("--runs-dir", default="runs", help="the comparison goes to <runs-dir>/make-run")
    p.add_argument("--loopback", action="store_true", help="force loopback even when root")
    p.add_argument("--sparse", default=None, metavar="CONFIGS",
                   help='";"-separated sparse configurations (compare syntax) instead of the default '
                        f'"{";".join(DEFAULT_SPARSE)}"')
    p.add_argument("--optimizer", default=None, choices=["sgd", "momentum", "nesterov", "adam"],
                   help=f"the optimizer of every row (default: {OPTIMIZER} for digits-mlp, the workload's own "
                        "otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(a) -> int:
    from .compare import compare

    network, notes = "1gbit", []
    reason = None
    if a.loopback:
        reason = "--loopback given"
    else:
        try:
            from ..cluster import netns_unavailable_reason

            reason = netns_unavailable_reason()
        except ImportError as e:
            reason = f"sparsync.cluster is not available ({e})"
    if reason:
        network = "loopback"
        msg = (f"NOTE: running over LOOPBACK, not the emulated 1 Gbit/s network ({reason}). Loopback moves "
               "~5 GB/s, so dense all-reduce is cheap and sparse methods show little gain; run `make run` as "
               "root for the emulated cluster.")
        print(msg, flush=True)
        notes.append(msg)
    else:
        print(f"running on the emulated cluster: {a.workers} ranks, one network namespace each, 1 Gbit/s per "
              "host link", flush=True)
        notes.append(f"emulated cluster: {a.workers} ranks in network namespaces, tc tbf 1 Gbit/s on every host "
                     "link; the ranks share this machine's 2 CPU cores")
    sparse = a.sparse if a.sparse is not None else ";".join(DEFAULT_SPARSE)
    configs = ";".join(["nocomm", "dense", *TORCH_ROWS, sparse])
    steps = a.steps if a.steps is not None else (100 if a.workload == "digits-mlp" else None)
    args = argparse.Namespace(
        workload=a.workload, workers=a.workers, bandwidth=None if network == "loopback" else network,
        loopback=network == "loopback", thread=False, steps=steps, epochs=None, batch_size=None, lr=None,
        optimizer=a.optimizer or (OPTIMIZER if a.workload == "digits-mlp" else None), target_accuracy=None,
        eval_every=None, seed=0, workload_option=None, runs_dir=a.runs_dir,
        force=True, no_progress=a.no_progress, timeout=900.0, configs=configs, density=0.01,
        merge="single", no_baselines=True, name="make-run", ddp_option=None)
    report, _ = compare(args, notes=notes, title=f"make run: {a.workload}, {a.workers} workers, {network}")
    summaries = [json.loads(p.read_text()) for p in sorted(report.parent.glob("*/summary.json"))]
    print(verdict(summaries))
    return 0


def verdict(summaries: list[dict]) -> str:
    """Issue 10's goal, checked on make run's own rows.

    The best sparse configuration is the one with the least time to target among those that end
    within 0.5 accuracy points of dense SparseDDP (a faster one that ends lower is not what a user
    would pick; when none qualifies, the fastest). It must reach the target in <= 0.5x torch DDP +
    fp16's time and in less than both PowerSGD rows' (a row that never reached it counts as
    infinitely slow), end within 0.5 accuracy points of dense SparseDDP, and take <= 1.5x the
    no-communication floor's step. Also reported: dense SparseDDP's step against torch DDP's
    (goal <= 1.05x)."""
    by = {s["reducer"]: s for s in summaries if s["reducer"] in ("dense", "nocomm", *TORCH_ROWS)}
    sparse = [s for s in summaries if s["reducer"] not in by]
    if "dense" not in by or "ddp-fp16" not in by or not sparse:
        return "goal: cannot judge (dense, torch ddp-fp16 or the sparse runs missing)"
    reached = [s for s in sparse if s.get("time_to_target_s") is not None]
    if not reached:
        return "goal NOT met: no sparse configuration reached the target accuracy"
    d_acc = by["dense"].get("final_accuracy")
    accurate = [s for s in reached if d_acc is not None and s.get("final_accuracy") is not None
                and 100 * (d_acc - s["final_accuracy"]) <= 0.5]
    best = min(accurate or reached, key=lambda s: s["time_to_target_s"])
    tt = best["time_to_target_s"]
    inf = float("inf")
    ttt = lambda r: inf if r not in by or by[r].get("time_to_target_s") is None else by[r]["time_to_target_s"]
    checks = []
    fp16 = ttt("ddp-fp16")
    checks.append((tt <= 0.5 * fp16, f"time to target {tt / fp16:.2f}x torch DDP + fp16 (goal <= 0.5)"))
    for r in ("ddp-powersgd1", "ddp-powersgd4"):
        if r in by:
            t = ttt(r)
            checks.append((tt < t, f"{'faster' if tt < t else 'NOT faster'} than {r} "
                                   f"({'not reached' if t == inf else f'{t:.2f} s'})"))
    if d_acc is not None and best.get("final_accuracy") is not None:
        gap = 100 * (d_acc - best["final_accuracy"])
        where = f"{gap:.2f} points below" if gap > 0 else f"{-gap:.2f} points above"
        checks.append((gap <= 0.5, f"final accuracy {where} dense (goal: at most 0.5 below)"))
    floor = (by.get("nocomm") or {}).get("median_step_s")
    if floor and best.get("median_step_s"):
        x = best["median_step_s"] / floor
        checks.append((x <= 1.5, f"step {x:.2f}x the no-communication floor (goal <= 1.5)"))
    ok = all(c for c, _ in checks)
    lines = [f"goal {'MET' if ok else 'NOT met'}: best sparse {best['label']} reached the target in {tt:.2f} s"]
    lines += [f"  [{'ok' if c else 'NO'}] {msg}" for c, msg in checks]
    ddp_step, dense_step = (by.get("ddp") or {}).get("median_step_s"), by["dense"].get("median_step_s")
    if ddp_step and dense_step:
        lines.append(f"  (dense SparseDDP step {dense_step / ddp_step:.2f}x torch DDP's; goal <= 1.05)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0)
