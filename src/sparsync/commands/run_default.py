"""``sparsync run-default`` (what ``make run`` calls): the default comparison, repeated, about ten minutes.

digits wide MLP (64-2048-2048-10, 4.35M parameters), 4 workers, on the emulated 1 Gbit/s cluster
when this process may build one (root + iproute2), otherwise over loopback — said clearly, because
on loopback the wire is ~40x faster and sparse methods have little to win. Configurations
(:data:`STEPS` steps each): the **no-communication floor row** (same model and data, gradients never
exchanged), dense SparseDDP, what a user would pick instead — torch DDP plain, with its fp16
compression hook, with its PowerSGD hook at rank 1 and 4 (torch's own ``PowerSGDState``, error
feedback and warm start) — and the default sparse configurations (:data:`DEFAULT_SPARSE`: reducer,
density, convergence options of :mod:`sparsync.convergence`, merge plan).

Every configuration runs once per round, :data:`ROUNDS` rounds (seeds 0, 1, 2), round-robin
(``sparsync compare --seeds``), so a slow minute of the machine hits every row of a round alike; the
table gives medians with 95 % bootstrap intervals and :func:`verdict` judges the goals
(:data:`GOAL_TTT`, :data:`GOAL_ACC`, :data:`GOAL_FLOOR`, :data:`GOAL_LOCAL`) on ratios taken within
each round, saying "not decided" where an interval straddles a goal. The
held-out set is the workload's 360 images (:data:`N_TEST`), evaluated every :data:`EVAL_EVERY` steps,
and time to target is interpolated between evaluations. (A 1024-image held-out set, where one image
is under 0.1 point, leaves 773 training images: a different, harder job; ``sparsync compare
--workload-option n_test=1024`` runs it.)
Ends with the table, the verdict and the report's path. ``--workers`` and ``--workload lm`` give
the other tables of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: the sparse configurations ``make run`` shows, best first (``sparsync compare --configs`` syntax),
#: chosen by the steps-to-target measurements in docs/benchmarks.md ("End to end"): fp16 values halve
#: the bytes on the wire; momentum correction takes the rows' kind of momentum (Nesterov's with
#: OPTIMIZER, the label says so). Plain ``micro:0.01`` (no convergence options) is left out to fit the
#: repeated rounds (``--sparse`` brings it back).
DEFAULT_SPARSE = ["micro:0.02,momentum=0.9,masking=false,warmup_steps=20,warmup_start=0.05,value_dtype=fp16",
                  "micro:0.01,momentum=0.9,masking=false,warmup_steps=20,warmup_start=0.05,value_dtype=fp16",
                  "diloco:16", "micro:0.05,sync_every=16"]
#: what the rounds cost: trimmed from one 100-step round of nine rows to fit ROUNDS rounds in ~10 minutes
TRIMMED = ("80 steps per run instead of 100 (every row crossed the target by step 60 so far); plain micro 1 % "
           "left out (--sparse brings it back)")
#: the optimizer of every row of the digits table (torch DDP's included; other workloads keep their
#: own): SGD with Nesterov momentum 0.9. It reaches the
#: target in fewer steps than plain momentum for dense and sparse training alike on this workload
OPTIMIZER = "nesterov"
#: torch DDP baselines in make run's table
#: (post-local SGD at H = 16: the fastest of H in {8, 16, 32} on this job, as DiLoCo's and sparse DiLoCo's H)
TORCH_ROWS = ["ddp", "ddp-fp16", "ddp-powersgd1", "ddp-powersgd4", "ddp-localsgd16"]
#: digits-mlp in make run: steps per run, rounds (one seed each), evaluation grid, held-out images
STEPS, ROUNDS, EVAL_EVERY, N_TEST = 80, 3, 2, 360
#: the project's goals (verdict): time to target vs torch DDP + fp16, accuracy gap to dense (points),
#: step vs the floor
GOAL_TTT, GOAL_ACC, GOAL_FLOOR = 0.5, 0.5, 1.5
#: against torch's post-local SGD (local steps): the best sparsync row's time to target
GOAL_LOCAL = 0.5


def register(sub) -> None:
    p = sub.add_parser("run-default", help="the default comparison `make run` shows (about ten minutes)")
    from . import WORKERS

    p.add_argument("--steps", type=WORKERS, default=None,
                   help=f"steps per configuration (default {STEPS}; lm: its own)")
    p.add_argument("--repeats", type=WORKERS, default=1, help="rounds per seed (default 1)")
    p.add_argument("--seeds", type=WORKERS, default=ROUNDS,
                   help=f"seeds 0 .. N-1, one round each (default {ROUNDS}): every row runs once per round")
    p.add_argument("--workers", type=WORKERS, default=4, help="ranks (processes)")
    p.add_argument("--workload", default="digits-mlp",
                   help="digits-mlp (default), lm, or gpt: the transformer comparison at r ~ 20 (gpt-long, 100 Mbit/s)")
    p.add_argument("--runs-dir", default="runs", help="the comparison goes to <runs-dir>/make-run")
    p.add_argument("--loopback", action="store_true", help="force loopback even when root")
    p.add_argument("--sparse", default=None, metavar="CONFIGS",
                   help='";"-separated sparse configurations (compare syntax) instead of the default '
                        f'"{";".join(DEFAULT_SPARSE)}"')
    p.add_argument("--optimizer", default=None, choices=["sgd", "momentum", "nesterov", "adam"],
                   help=f"the optimizer of every row (default: {OPTIMIZER} for digits-mlp, the workload's own "
                        "otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs an interrupted make run finished (runs/make-run) and run the rest")
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
    if a.workload in ("gpt", "gpt-long"):
        from ._run_default_gpt import run_gpt

        return run_gpt(a, reason)
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
    digits = a.workload == "digits-mlp"
    steps = a.steps if a.steps is not None else (STEPS if digits else None)
    if digits:
        notes.append(f"held-out set: {N_TEST} images (one image = {100 / N_TEST:.3f} accuracy points), evaluated "
                     f"every {EVAL_EVERY} steps; time to target interpolated between evaluations")
    if digits and a.steps is None and a.sparse is None:
        notes.append(f"trimmed to fit {a.repeats * a.seeds} rounds in ~10 minutes: {TRIMMED}")
    args = argparse.Namespace(
        workload=a.workload, workers=a.workers, bandwidth=None if network == "loopback" else network,
        loopback=network == "loopback", thread=False, steps=steps, epochs=None, batch_size=None, lr=None,
        optimizer=a.optimizer or (OPTIMIZER if digits else None), target_accuracy=None,
        eval_every=EVAL_EVERY if digits else None, seed=0,
        workload_option=[f"n_test={N_TEST}"] if digits else None, runs_dir=a.runs_dir,
        force=True, no_progress=a.no_progress, timeout=900.0, configs=configs, density=0.01,
        merge="single", no_baselines=True, name="make-run", ddp_option=None, repeats=a.repeats, seeds=a.seeds,
        resume=a.resume)
    print(f"{a.repeats * a.seeds} rounds x {len(configs.split(';'))} rows, round-robin; every row once per round"
          + (f" ({notes[-1]})" if notes and notes[-1].startswith("trimmed") else ""), flush=True)
    said = []

    def add_verdict(staged: Path) -> None:  # into the report before it is moved in, under the comparison's lock
        from ..train.ownership import atomic_write

        said.append(verdict(json.loads((staged / "comparison.json").read_text())["runs"]))  # this run's, no other
        atomic_write(staged / "report.md", (staged / "report.md").read_text() + "\n## Verdict\n\n"
                     + "".join(f"    {line}\n" for line in said[0].splitlines()) + "\n")

    compare(args, notes=notes, title=f"make run: {a.workload}, {a.workers} workers, {network}", finish=add_verdict)
    print(said[0])
    return 0


_MARK = {"yes": "ok", "no": "NO", "not decided": "??"}


def verdict(summaries: list[dict]) -> str:
    """The project's goals, checked on make run's own runs (one or more rounds).

    The best sparse configuration is the one with the least median time to target among those whose
    final accuracy is, in median over the rounds, within :data:`GOAL_ACC` points of dense SparseDDP
    (a faster one that ends lower is not what a user would pick; when none qualifies, the fastest).
    It must reach the target in <= :data:`GOAL_TTT` x torch DDP + fp16's time and in less than
    both PowerSGD rows' (a run that never reached it counts as infinitely slow), end within
    :data:`GOAL_ACC` points of dense, and take <= :data:`GOAL_FLOOR` x the floor's step (the
    round's least compute time per step, :func:`sparsync.train.report.floors`). Every ratio and
    gap is taken within each round, then summarised as the median with its 95 % bootstrap interval;
    a check whose interval straddles its goal is "not decided" (``[??]``), and the goal as a whole
    is MET when every check is, NOT met when any check fails outright, NOT DECIDED otherwise. Also
    reported: dense SparseDDP's step against torch DDP's (goal <= 1.05x)."""
    from ..train.report import aggregate, ratio_to
    from ..train.stats import decide, interval, paired_ratios

    agg = aggregate(summaries)
    by = {a["reducer"]: a for a in agg if a["reducer"] in ("dense", "nocomm", *TORCH_ROWS)}
    sparse = [a for a in agg if a["reducer"] not in by]
    if "dense" not in by or "ddp-fp16" not in by or not sparse:
        return "goal: cannot judge (dense, torch ddp-fp16 or the sparse runs missing)"
    reached = [a for a in sparse if a["time_to_target_s"] is not None and a["time_to_target_s"].mid != float("inf")]
    if not reached:
        return "goal NOT met: no sparse configuration reached the target accuracy"
    rnd = lambda a, k: {r.get("round", 0): r.get(k) for r in a["runs"]}
    gap = {a["config"]: interval([100 * x for x in _diffs(rnd(by["dense"], "final_accuracy"),
                                                            rnd(a, "final_accuracy"))]) for a in sparse}
    accurate = [a for a in reached if gap[a["config"]] is not None and gap[a["config"]].mid <= GOAL_ACC]
    best = min(accurate or reached, key=lambda a: a["time_to_target_s"].mid)
    ttt = lambda iv: iv.format(lambda x: f"{x:.2f}")
    checks = []
    r16 = ratio_to(best, by["ddp-fp16"])
    checks.append((decide(r16, GOAL_TTT), f"time to target {ttt(r16)}x torch DDP + fp16 (goal <= {GOAL_TTT:g})"))
    local = [a for r, a in by.items() if r.startswith("ddp-localsgd")]
    if local:
        fastest = min(local, key=lambda a: a["time_to_target_s"].mid if a["time_to_target_s"] else float("inf"))
        rl = ratio_to(best, fastest)
        if rl is not None:
            checks.append((decide(rl, GOAL_LOCAL), f"time to target {ttt(rl)}x torch post-local SGD "
                                                   f"({fastest['label']}; goal <= {GOAL_LOCAL:g})"))
    for r in ("ddp-powersgd1", "ddp-powersgd4"):
        if r in by:
            iv = ratio_to(best, by[r])
            d = decide(iv, 1.0)
            word = {"yes": "faster", "no": "NOT faster", "not decided": "not decided: faster"}[d]
            base = by[r]["time_to_target_s"]
            zero = lambda x: "0" if x == 0 else f"{x:.2f}"  # 0: a round where it never reached the target
            checks.append((d, f"{word} than {r}: {iv.format(zero) if iv else '-'}x its time to target "
                              f"({'not reached' if base is None else base.format(lambda x: f'{x:.2f} s')})"))
    g = gap[best["config"]]
    if g is not None:
        if g.hi <= 0:
            where = f"{ttt(type(g)(-g.mid, -g.hi, -g.lo, g.n))} points above"
        elif g.lo >= 0:
            where = f"{ttt(g)} points below"
        else:
            where = f"{ttt(g)} points below (negative: above)"
        checks.append((decide(g, GOAL_ACC), f"final accuracy {where} dense (goal: at most {GOAL_ACC:g} below)"))
    xf = best["x_floor"]
    if xf is not None:
        checks.append((decide(xf, GOAL_FLOOR), f"step {ttt(xf)}x the floor (goal <= {GOAL_FLOOR:g}; floor = the "
                                               "round's least compute time per step)"))
    states = [c for c, _ in checks]
    ok = "MET" if all(c == "yes" for c in states) else "NOT met" if "no" in states else "NOT DECIDED"
    n = best["n"]
    lines = [f"goal {ok}: best sparsync row {best['label']} reached the target in "
             f"{best['time_to_target_s'].format(lambda x: f'{x:.2f}')} s"
             + (f" (median [95 % interval] over {n} rounds)" if n > 1 else "")]
    lines += [f"  [{_MARK[c]}] {'not decided: ' if c == 'not decided' and 'faster' not in msg else ''}{msg}"
              for c, msg in checks]
    if "ddp" in by:
        dd = interval(paired_ratios(rnd(by["dense"], "median_step_s"), rnd(by["ddp"], "median_step_s")))
        if dd is not None:
            lines.append(f"  (dense SparseDDP step {ttt(dd)}x torch DDP's; goal <= 1.05)")
    return "\n".join(lines)


def _diffs(base: dict, row: dict) -> list[float]:
    """``base[k] - row[k]`` for every round both measured."""
    return [base[k] - row[k] for k in sorted(set(base) & set(row), key=str)
            if base[k] is not None and row[k] is not None]


if __name__ == "__main__":
    sys.exit(0)
