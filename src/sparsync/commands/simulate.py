"""``sparsync simulate``: alpha-beta collective simulation and MG-WFBP schedule simulation.

::

    sparsync simulate collectives [--numel 65536] [--density 0.01] [--latency 50us] [--bandwidth 1gbit]
                                  [--max-exec-p 256] [--only NAME,...] [--out docs/img]
    sparsync simulate profile --model resnet50 [--out profile.json]     # measure t_b per tensor
    sparsync simulate schedule [--model resnet50 | --profile profile.json] [--algorithm ring|dbtree]
                               [--latency 32.4us --bandwidth 7.6gbit] [--out docs/img]

The network is a per-message latency (alpha) and a link rate (beta = 1/rate), read like every other
rate of the CLI (docs/train.md, "Units"). See docs/simulator.md for the method and the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import COUNT, DENSITY, DURATION, RATE, WORKERS, UsageError, deprecated_alias, doc_text

ALGORITHMS = ("ring", "dbtree", "rec_doubling")


def _beta(rate: str | None) -> float | None:
    """Seconds per byte of a rate (``"1gbit"`` -> 8e-9)."""
    from ..units import parse_rate

    return None if rate is None else 8.0 / parse_rate(rate)


def _seconds_per_byte(s: str) -> str:
    """Old ``--beta`` (seconds per byte, ``8e-9``) -> the rate it means, so both spellings meet in
    ``bandwidth``; a rate (``1gbit``) is taken as one."""
    import argparse

    from ..units import format_rate, parse_duration, parse_rate

    try:
        return format_rate(float(f"{8.0 / parse_duration(s):.9g}"))  # 8/8e-9 is 999999999.99...
    except ValueError:
        pass
    try:
        return format_rate(parse_rate(s))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--beta takes seconds per byte (8e-9) or a rate (1gbit): {e}") from None


def register(sub) -> None:
    p = sub.add_parser("simulate", help="alpha-beta collective simulation and MG-WFBP schedule simulation",
                       description=doc_text(__doc__.split("\n", 1)[1]))
    s = p.add_subparsers(dest="what", metavar="WHAT")
    c = s.add_parser("collectives", help="formula vs executed (thread virtual clock) time of every algorithm")
    c.add_argument("--numel", type=COUNT, default=1 << 16, help="gradient length")
    deprecated_alias(c, "--n", "--numel", "numel", COUNT)
    c.add_argument("--density", type=DENSITY, default=0.01, help="fraction of entries each rank contributes")
    c.add_argument("--latency", type=DURATION, default="50us", help="latency per message (alpha)")
    deprecated_alias(c, "--alpha", "--latency", "latency", DURATION)
    c.add_argument("--bandwidth", type=RATE, default="1gbit", help="link rate (beta = 1/rate)")
    deprecated_alias(c, "--beta", "--bandwidth", "bandwidth", _seconds_per_byte)
    c.add_argument("--max-p", type=WORKERS, default=4096, help="largest P for the formulas")
    c.add_argument("--max-exec-p", type=WORKERS, default=256, help="largest P for the executed simulation")
    c.add_argument("--only", default=None, help="comma-separated algorithm / reducer names (default: all)")
    c.add_argument("--out", default="docs/img", help="directory for sim_collectives.png / .json")
    c.set_defaults(func=run_collectives)
    pr = s.add_parser("profile", help="measure a model's per-tensor backward times (engine profiler)")
    pr.add_argument("--model", default="resnet50", help="resnet50 | resnet152 | digits-mlp | digits-cnn | lm")
    pr.add_argument("--batch-size", type=WORKERS, default=None, help="(default: the model's)")
    deprecated_alias(pr, "--batch", "--batch-size", "batch_size", WORKERS)
    pr.add_argument("--image", type=WORKERS, default=None, help="image side for the ResNets (default: the model's)")
    pr.add_argument("--steps", type=WORKERS, default=5, help="profiled backward passes")
    pr.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    pr.add_argument("--out", default=None, help="profile JSON (default runs/profiles/<model>.json)")
    pr.set_defaults(func=run_profile)
    sc = s.add_parser("schedule", help="MG-WFBP trace simulation, 4..2048 workers, speed-up plot")
    sc.add_argument("--model", default=None, help="profile this model now (if no --profile); default resnet50")
    sc.add_argument("--profile", action="append", default=None, help="profile JSON(s) from `simulate profile`")
    sc.add_argument("--algorithm", action="append", default=None, choices=ALGORITHMS,
                    help="all-reduce model, repeatable (default: ring and dbtree)")
    sc.add_argument("--latency", type=DURATION, default=None,
                    help="latency per message (default: from the paper's K80/10GbE fit, 32.4us)")
    deprecated_alias(sc, "--alpha", "--latency", "latency", DURATION)
    sc.add_argument("--bandwidth", type=RATE, default=None,
                    help="link rate (default: from the paper's fit, 1.05e-9 s/byte = 7.6gbit)")
    deprecated_alias(sc, "--beta", "--bandwidth", "bandwidth", _seconds_per_byte)
    sc.add_argument("--out", default="docs/img", help="directory for sim_schedule_<model>.png / .json")
    sc.set_defaults(func=run_schedule)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def run_collectives(a) -> int:
    from ..sim import collectives as C

    names = None
    if a.only:
        names = {x.strip() for x in a.only.split(",") if x.strip()}
        valid = {x.name for x in C.algorithms()}
        if names - valid:
            raise UsageError(f"--only: unknown {', '.join(sorted(names - valid))}; valid: {', '.join(sorted(valid))}")
    out = Path(a.out)
    pred_ps = [2 ** i for i in range(1, 13) if 2 ** i <= a.max_p]
    exec_ps = [p for p in (2, 4, 8, 16, 32, 64, 128, 256) if p <= a.max_exec_p]
    try:
        res = C.sweep(a.numel, a.density, a.latency, _beta(a.bandwidth), pred_ps, exec_ps, names)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_collectives.json").write_text(json.dumps(res, indent=1))
    C.plot(res, out / "sim_collectives.png")
    bad = [r for r in res["executed"] if not r["ok"]]
    print(f"{len(res['executed']) - len(bad)}/{len(res['executed'])} executed ledgers equal their formula "
          f"(within its bounds where sizes are random); plot: {out / 'sim_collectives.png'}")
    for r in bad:
        print(f"  DIFFERS: {r['algo']} P={r['P']}: ledger rounds {r['exec_rounds']} bytes {r['exec_bytes_received']}, "
              f"formula rounds {r['pred_rounds']} bytes {r['pred_bytes']}")
    return 0


def run_profile(a) -> int:
    import torch

    from ..sim import schedule as S

    torch.set_num_threads(1)
    try:
        prof = S.profile_model(a.model, a.batch_size, a.image, steps=a.steps, device=a.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    path = Path(a.out or f"runs/profiles/{a.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof, indent=1))
    print(f"{a.model}: {prof['tensors']} tensors, {prof['params']} parameters, t_f {1e3 * prof['t_f']:.1f} ms, "
          f"t_b {1e3 * sum(prof['t_b']):.1f} ms on {prof['device']}; profile: {path}")
    return 0


def run_schedule(a) -> int:
    import torch

    from ..sim import schedule as S

    torch.set_num_threads(1)
    try:
        profiles = [S.load_profile(p) for p in a.profile] if a.profile else \
            [S.profile_model(a.model or "resnet50")]
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    algos = a.algorithm or ["ring", "dbtree"]
    alpha, beta = a.latency, _beta(a.bandwidth)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for prof in profiles:
        panels, dump = {}, {"profile": {k: prof[k] for k in prof if k not in ("t_b", "sizes", "order")}}
        for alg in algos:
            Ns = [2 ** i for i in range(2, 12)] if alg == "ring" else [2 ** i for i in range(7, 12)]
            rows = S.simulate(prof, Ns, alg, alpha, beta)
            panels[f"{prof['model']}, {alg} all-reduce"] = rows
            dump[alg] = rows
            print(f"{prof['model']} ({prof['tensors']} tensors), {alg}: speed-up")
            print("   N   " + "  ".join(f"{s:>9s}" for s in S.STRATEGIES) + "   groups(mgwfbp/optimal)")
            for N in Ns:
                rs = {r["strategy"]: r for r in rows if r["N"] == N}
                print(f"{N:5d}  " + "  ".join(f"{rs[s]['speedup']:9.2f}" for s in S.STRATEGIES) +
                      f"   {rs['mgwfbp']['groups']}/{rs['optimal']['groups']}")
        name = prof["model"]
        S.plot_speedup(panels, out / f"sim_schedule_{name}.png",
                       f"MG-WFBP trace simulation: {name} profile measured on {prof['device']} "
                       f"(batch {prof.get('batch')}), a,b from the paper's K80/10GbE fit")
        (out / f"sim_schedule_{name}.json").write_text(json.dumps(dump, indent=1))
        print(f"plot: {out / f'sim_schedule_{name}.png'}")
    return 0
