"""``sparsync compare``: several configurations of one workload, side by side, one report.

``--configs "dense;ddp;ddp-fp16;micro:0.01;spardl:0.01,merge=wfbp,option=value"`` — configurations
separated by ``;``; each is ``NAME[:DENSITY][,key=value...]`` where ``NAME`` is a registered reducer
or ``ddp`` / ``ddp-fp16`` (torch's DDP, plain / fp16 compression hook), ``merge=`` sets the merge
plan, ``momentum=``, ``nesterov=``, ``masking=``, ``warmup_steps=``, ``warmup_start=``, ``clip=`` are convergence
options (:mod:`sparsync.convergence`; they override the ``--momentum-correction`` ... flags),
``delay=1`` is SparseDDP's delayed averaging (docs/engine.md), ``sync_every=H`` (with
``outer=``, ``outer_lr=``, ``outer_momentum=``, ``overlap=``) runs the reducer as DiLoCo's pseudo-gradient
exchange every H steps (``diloco:H`` = ``dense,sync_every=H``; docs/localsteps.md), ``adam_freeze=N`` makes the row's
AdamW freeze its second moment after N steps (:mod:`sparsync.adam`), and any other key is a reducer
option. ``ddp-localsgd<H>[,warmup=N]`` is torch's post-local SGD averaging every H steps,
``ddp-powersgd1`` / ``ddp-powersgd4`` are torch's PowerSGD hook and
``nocomm`` the no-communication row (one of the candidates for the floor,
:mod:`sparsync.train.report`). The configurations run one after the other on the same
network (so they never compete for the 2 cores), each into ``<runs-dir>/<name>/<config>/``; the
report (``report.md`` + PNG plots, :mod:`sparsync.train.report`) and the same numbers as data
(``comparison.csv``, ``comparison.json``; in Python ``sparsync.train.load_runs(dir)``) go to
``<runs-dir>/<name>/``. Baselines dense SparseDDP, torch DDP and torch DDP + fp16 hook are added
unless ``--no-baselines``. Every configuration is checked (names, options, merge plan, network)
before the first one starts.

``--repeats R --seeds S`` runs every configuration R x S times, in R x S *rounds* (repeat r, seed
``--seed`` + s), round-robin - A B C, A B C, ... - so that a slow minute of the machine hits every
row of a round alike; each run goes to ``<runs-dir>/<name>/<config>/r<repeat>-s<seed>/``. The
report gives each number as the median over the rounds with a 95 % bootstrap interval, and ratios
between rows are taken within a round first (:mod:`sparsync.train.stats`). ``--resume`` keeps the
runs a previous, interrupted invocation finished (same configuration) and runs the rest.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from . import DENSITY, QUOTE_HINT, UsageError, doc_text, split_unquoted
from .train import _parse_value, add_common, config_from_args, convergence_of, preflight, tensorboard_tail

BASELINES = ("dense", "ddp", "ddp-fp16")
DDP_KEYS = ("delay",)  # config keys that are SparseDDP keywords (the rest: merge, policy or reducer options)
TRAIN_KEYS = ("adam_freeze",)  # config keys that are TrainConfig fields of the row


def parse_configs(spec: str, density: float, merge: str) -> list[dict]:
    """``"dense;micro:0.01,merge=wfbp"`` -> ``[{"reducer", "density", "merge", "options"}, ...]``. A value
    holding ``;`` or ``,`` is quoted: ``hier:0.02,sites="0,2;1,3"`` (split outside quotes only)."""
    from ..convergence import POLICY_OPTIONS
    from ..localsteps.trainer import LOCAL_KEYS

    out = []
    for item in split_unquoted(spec, ";", "--configs"):
        item = item.strip()
        if not item:
            continue
        head, *kvs = split_unquoted(item, ",", "--configs")
        name, _, dens = head.partition(":")
        d = {"reducer": name.strip(), "density": density, "merge": merge, "options": {}, "convergence": None,
             "ddp": {}, "train": {}, "local": {}}
        if d["reducer"] == "diloco":  # diloco:H = dense DiLoCo
            if not dens.strip().isdigit():
                raise UsageError(f"config {item!r}: write diloco:H with H the steps between synchronisations")
            d["reducer"], d["local"]["sync_every"], dens = "dense", int(dens), ""
        if dens:
            try:
                d["density"] = float(dens)
            except ValueError:
                raise UsageError(f"config {item!r}: density {dens!r} is not a number") from None
        for kv in kvs:
            if "=" not in kv:
                raise UsageError(f"config {item!r}: {kv!r} should be key=value ({QUOTE_HINT})")
            k, v = kv.split("=", 1)
            if k.strip() == "merge":
                d["merge"] = v.strip()
            elif k.strip() in DDP_KEYS:
                d["ddp"][k.strip()] = _parse_value(v.strip())
            elif k.strip() in TRAIN_KEYS:
                d["train"][k.strip()] = _parse_value(v.strip())
            elif k.strip() in LOCAL_KEYS:
                d["local"][k.strip()] = _parse_value(v.strip())
            elif k.strip() in POLICY_OPTIONS:
                d["convergence"] = {**(d["convergence"] or {}), k.strip(): _parse_value(v.strip())}
            else:
                d["options"][k.strip()] = _parse_value(v.strip())
        out.append(d)
    if not out:
        raise UsageError("--configs is empty")
    return out


def config_slug(c: dict) -> str:
    r = c["reducer"]
    s = r if r in BASELINES or r.startswith("ddp-") or r == "nocomm" else f"{r}-{c['density']:g}"
    s += "-" + c["merge"].replace(":", "")
    for k, v in sorted({**c["options"], **(c.get("convergence") or {}), **(c.get("ddp") or {}),
                        **(c.get("train") or {}), **(c.get("local") or {})}.items()):
        s += f"-{k}{v}"
    return s


def register(sub) -> None:
    p = sub.add_parser("compare", help="run several configurations and write a report",
                       description=doc_text(__doc__.split("\n", 1)[1].strip()))
    add_common(p, compare=True)
    p.add_argument("--configs", default="dense;ddp;ddp-fp16;topka:0.01",
                   help='";"-separated NAME[:DENSITY][,merge=PLAN][,key=value] (default %(default)s)')
    p.add_argument("--density", type=DENSITY, default=0.01, help="density for configs that give none")
    p.add_argument("--merge", default="single", help="merge plan for configs that give none")
    p.add_argument("--no-baselines", action="store_true", help="do not add dense, ddp and ddp-fp16")
    p.add_argument("--name", default=None, help="comparison name (directory <runs-dir>/<name>)")
    p.add_argument("--checkpoints", action="store_true", help="keep each configuration's final checkpoint")
    from . import WORKERS

    p.add_argument("--repeats", type=WORKERS, default=1, help="rounds per seed: every configuration runs once per "
                   "round, round-robin (default 1)")
    p.add_argument("--seeds", type=WORKERS, default=1, help="seeds --seed, --seed+1, ...: one round each per "
                   "repeat (default 1)")
    p.add_argument("--resume", action="store_true", help="keep the runs of this comparison that finished before "
                   "(same configuration) and run the others")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..train.loop import NetworkUnavailable
    from ..train.runs import CheckpointError, RunExists

    plan(args)  # UsageError (one line, exit 2) before anything runs or is written
    try:
        compare(args)
    except (ValueError, CheckpointError, RunExists, NetworkUnavailable) as e:
        print(f"sparsync compare: error: {e}", file=sys.stderr)
        return 2
    except AllConfigurationsFailed as e:
        print(f"sparsync compare: error: {e}", file=sys.stderr)
        return 1
    return 0


class AllConfigurationsFailed(RuntimeError):
    """No configuration of a comparison finished (each failure was printed as it happened)."""


def plan(args) -> tuple[Path, list]:
    """The comparison directory and every configuration, each checked by :func:`preflight` (names,
    reducer / workload / SparseDDP options, merge plan) and the network once — nothing runs or is
    written. Raises :class:`UsageError` naming the configuration at fault."""
    configs = parse_configs(args.configs, args.density, args.merge)
    if not args.no_baselines:
        have = {c["reducer"] for c in configs if not c.get("local")}
        configs = [{"reducer": b, "density": args.density, "merge": args.merge, "options": {}, "convergence": {}}
                   for b in BASELINES if b not in have] + configs
    name = args.name if args.name is not None else f"compare-{args.workload}-P{args.workers}"
    _check_name(name, "--name")
    root = Path(args.runs_dir) / name
    cfgs, seen = [], set()
    for i, c in enumerate(configs):
        slug = config_slug(c)
        while slug in seen:
            slug += "+"
        seen.add(slug)
        _check_name(slug, f"configuration {c['reducer']!r}: its directory name")
        conv = dict(c.get("convergence") or {})
        if not (c["reducer"] in BASELINES or c["reducer"].startswith("ddp-") or c["reducer"] == "nocomm"
                or c.get("local")):
            conv = {**convergence_of(args), **conv}  # the flags apply to the per-step sparse configurations
        cfg = config_from_args(args, reducer=c["reducer"], density=c["density"], merge=c["merge"],
                               options=c["options"], name=slug, convergence=conv)
        cfg.ddp_options = {**cfg.ddp_options, **(c.get("ddp") or {})}
        for k, v in (c.get("train") or {}).items():
            setattr(cfg, k, v)
        cfg.local_steps = dict(c.get("local") or {})
        cfg.runs_dir = str(root)
        cfg.final_checkpoint = bool(getattr(args, "checkpoints", False))
        try:
            preflight(cfg, network=i == 0)
        except UsageError as e:
            raise UsageError(f"configuration {c['reducer']!r}: {e}") from None
        cfgs.append(cfg)
    return root, cfgs


def _check_name(name: str, what: str) -> None:
    """A comparison's or a configuration's directory name is one path component (UsageError otherwise)."""
    from ..train.runs import check_run_name

    try:
        check_run_name(name, what)
    except ValueError as e:
        raise UsageError(str(e)) from None


def rounds_of(repeats: int, seeds: int, seed0: int = 0) -> list[tuple[int, int]]:
    """``(repeat, seed)`` of every round, in the order the rounds run."""
    return [(r, seed0 + k) for r in range(repeats) for k in range(seeds)]


def schedule(root: Path, cfgs: list, rounds: list[tuple[int, int]]) -> list[dict]:
    """Every run of a comparison in launch order: round by round, and inside a round every
    configuration in the order given (round-robin: A B C, A B C, ...). Each job is ``{"round",
    "repeat", "seed", "index", "config", "cfg"}``, ``cfg`` a copy of the configuration with the
    round's seed and its own run directory: ``root/<config>/`` for a single round (the layout of a
    plain comparison), ``root/<config>/r<repeat>-s<seed>/`` otherwise."""
    import dataclasses

    jobs = []
    for k, (rep, seed) in enumerate(rounds):
        for i, cfg in enumerate(cfgs):
            c = dataclasses.replace(cfg, seed=seed, reducer_options=dict(cfg.reducer_options),
                                    workload_options=dict(cfg.workload_options),
                                    convergence=dict(cfg.convergence), ddp_options=dict(cfg.ddp_options))
            if len(rounds) > 1:
                c.runs_dir, c.name = str(root / cfg.name), f"r{rep}-s{seed}"
            jobs.append({"round": k, "repeat": rep, "seed": seed, "index": i, "config": cfg.name, "cfg": c})
    return jobs


def _finished(cfg) -> bool:
    """Whether ``cfg``'s run directory holds a finished run of exactly this configuration."""
    from ..train.runs import RunDir

    rd = RunDir(Path(cfg.runs_dir) / cfg.name)
    try:
        old = rd.read_config()
        return (rd.summary() is not None and old is not None and old.fingerprint() == cfg.fingerprint()
                and old.steps == cfg.steps)
    except (OSError, ValueError, TypeError):
        return False


def _clock(s: float) -> str:
    return f"{int(s) // 60}:{int(s) % 60:02d}"


def compare(args, notes: list[str] | None = None, title: str | None = None, finish=None):
    """Run every configuration; returns (report path, table rows). ``finish(staged_dir)``: the caller's
    additions to the report set (``run-default``'s verdict), called once report.md, the plots and the data
    are written into the staging directory - still under the comparison's lock, and moved into place
    with the rest (a failure leaves none of the set)."""
    import json

    from ..train.loop import launch
    from ..train.records import write_comparison
    from ..train.report import format_table, table_rows, write_report
    from ..train.ownership import named_errors, staged_files
    from ..train.runs import RunLock, prepare_dir

    root, cfgs = plan(args)
    resume = bool(getattr(args, "resume", False))
    rounds = rounds_of(getattr(args, "repeats", 1) or 1, getattr(args, "seeds", 1) or 1, args.seed)
    jobs = schedule(root, cfgs, rounds)
    tb = tensorboard_tail(getattr(args, "tensorboard", None), [_TbRun(j, len(rounds)) for j in jobs])
    # --force empties only a comparison directory sparsync made, and not while another process uses it;
    # --resume keeps the directory and its finished runs (still one writer: the lock)
    if resume and root.is_dir():
        lock = RunLock(root, "comparison directory").acquire()
    else:
        lock = prepare_dir(root, "compare", args.force, what="comparison directory")
    done, t0, ran = [], time.monotonic(), []
    with tb, contextlib.closing(lock):
        for n, job in enumerate(jobs):
            cfg = job["cfg"]
            path = Path(cfg.runs_dir) / cfg.name
            where = f"round {job['round'] + 1}/{len(rounds)} (seed {job['seed']}): " if len(rounds) > 1 else ""
            if resume and _finished(cfg):
                print(f"[{n + 1}/{len(jobs)}] {where}{cfg.label()}: finished before, kept", flush=True)
                done.append(path)
                continue
            spent = time.monotonic() - t0
            eta = f", about {_clock(sum(ran) / len(ran) * (len(jobs) - n))} left" if ran else ""
            print(f"[{n + 1}/{len(jobs)}] {where}{cfg.label()} on {cfg.workers} workers ({cfg.network}); "
                  f"{_clock(spent)} elapsed{eta}", flush=True)
            start = time.monotonic()
            try:
                # the row's fields go into summary.json with the run's own, under the run's lock
                launch(cfg, force=True, record={"config": job["config"], "config_index": job["index"],
                                                "round": job["round"], "repeat": job["repeat"]})
                done.append(path)
            except Exception as e:  # noqa: BLE001 - one failing config must not lose the others
                print(f"  {cfg.label()} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                      file=sys.stderr)
                (notes := notes if notes is not None else []).append(
                    f"configuration `{cfg.label()}`{' in ' + where.rstrip(': ') if where else ''} failed: "
                    f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            ran.append(time.monotonic() - start)
        if not done:  # a comparison directory made here that holds nothing else goes, lock file included
            lock.abandon()  # (every start failed on a full disk: nothing to --resume, nothing to --force)
            raise AllConfigurationsFailed(f"every configuration failed ({len(cfgs)}; the messages above say why)")
        title = title or (f"{args.workload}: {len(cfgs)} configurations"
                          + (f" x {len(rounds)} rounds" if len(rounds) > 1 else "")
                          + f", {cfgs[0].workers} workers, {cfgs[0].network}")
        # still under the comparison's lock (a --force elsewhere waits for it), and as one set: the
        # report, its plots and the data are moved into the directory only once every file is written
        summaries = [json.loads((d / "summary.json").read_text()) for d in done]
        rows = table_rows(summaries)
        with staged_files(root, "report") as tmp:
            with named_errors(tmp / "report.md"):  # each plot names its own file
                report = root / write_report(tmp, done, title, notes).name
            csv_path, json_path = write_comparison(tmp, [dict(s, path=str(d)) for s, d in zip(summaries, done)],
                                                   rows=aggregate_records(summaries))
            if finish is not None:
                finish(tmp)
    print()
    print(format_table(rows, markdown=False, compact=True))
    print(f"\nreport: {os.path.relpath(report)} (data: {csv_path.name}, {json_path.name}); "
          f"{len(done)} runs in {_clock(time.monotonic() - t0)}")
    return report, rows


class _TbRun:
    """What :func:`tensorboard_tail` needs of a run: its label (with the round when there are
    several) and its directory."""

    def __init__(self, job: dict, rounds: int):
        c = job["cfg"]
        self.runs_dir, self.name = c.runs_dir, c.name
        self._label = c.label() + (f" {c.name}" if rounds > 1 else "")

    def label(self) -> str:
        return self._label


def aggregate_records(summaries: list[dict]) -> list[dict]:
    """The table's rows as data (``comparison.json``'s ``rows``): per configuration, each quantity's
    median, low, high and number of runs."""
    from ..train.report import aggregate

    keys = ("step_s", "compute_s", "select_s", "comm_s", "wait_s", "bytes", "density", "time_to_target_s",
            "steps_to_target", "final_accuracy", "x_floor", "link_ratio", "utilisation", "speedup")
    return [{"config": a["config"], "label": a["label"], "short": a["short"], "reducer": a["reducer"], "n": a["n"],
             "speedup_kind": a["speedup_kind"], **{k: a[k].to_dict() if a[k] is not None else None for k in keys}}
            for a in aggregate(summaries)]
