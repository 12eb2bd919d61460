"""``sparsync simulate``: alpha-beta collective simulation and MG-WFBP schedule simulation.

::

    sparsync simulate collectives [--n 262144] [--density 0.01] [--alpha 50us] [--beta 8e-9]
                                  [--max-exec-p 256] [--only NAME,...] [--out docs/img]
    sparsync simulate profile --model resnet50 [--out profile.json]     # measure t_b per tensor
    sparsync simulate schedule [--model resnet50 | --profile profile.json] [--algorithm ring|dbtree]
                               [--out docs/img]

See ``docs/simulator.md`` for the method and the tolerance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _seconds(s: str) -> float:
    s = s.strip().lower()
    for suf, mul in (("us", 1e-6), ("ms", 1e-3), ("ns", 1e-9), ("s", 1.0)):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * mul
    return float(s)


def register(sub) -> None:
    p = sub.add_parser("simulate", help="alpha-beta collective simulation and MG-WFBP schedule simulation")
    s = p.add_subparsers(dest="what", metavar="WHAT")
    c = s.add_parser("collectives", help="formula vs executed (thread virtual clock) time of every algorithm")
    c.add_argument("--n", type=int, default=1 << 16, help="gradient length (default 65536)")
    c.add_argument("--density", type=float, default=0.01)
    c.add_argument("--alpha", default="50us", help="latency per message (default 50us)")
    c.add_argument("--beta", default="8e-9", help="seconds per byte (default 8e-9 = 1 Gbit/s)")
    c.add_argument("--max-p", type=int, default=4096, help="largest P for the formulas")
    c.add_argument("--max-exec-p", type=int, default=256, help="largest P for the executed simulation")
    c.add_argument("--only", default=None, help="comma-separated algorithm names")
    c.add_argument("--out", default="docs/img", help="directory for sim_collectives.png / .json")
    c.set_defaults(func=run_collectives)
    pr = s.add_parser("profile", help="measure a model's per-tensor backward times (engine profiler)")
    pr.add_argument("--model", default="resnet50", help="resnet50 | resnet152 | digits-mlp | digits-cnn | lm")
    pr.add_argument("--batch", type=int, default=None)
    pr.add_argument("--image", type=int, default=None, help="image side for the ResNets")
    pr.add_argument("--steps", type=int, default=5)
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--out", default=None, help="profile JSON (default runs/profiles/<model>.json)")
    pr.set_defaults(func=run_profile)
    sc = s.add_parser("schedule", help="MG-WFBP trace simulation, 4..2048 workers, speed-up plot")
    sc.add_argument("--model", default=None, help="profile this model now (if no --profile); default resnet50")
    sc.add_argument("--profile", action="append", default=None, help="profile JSON(s) from `simulate profile`")
    sc.add_argument("--algorithm", action="append", default=None, help="ring and/or dbtree (default both)")
    sc.add_argument("--alpha", default=None, help="default: from the paper's K80/10GbE fit (32.4us)")
    sc.add_argument("--beta", default=None, help="default: from the paper's fit (1.05e-9 s/byte)")
    sc.add_argument("--out", default="docs/img", help="directory for sim_schedule_<model>.png / .json")
    sc.set_defaults(func=run_schedule)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def run_collectives(a) -> int:
    from ..sim import collectives as C

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    pred_ps = [2 ** i for i in range(1, 13) if 2 ** i <= a.max_p]
    exec_ps = [p for p in (2, 4, 8, 16, 32, 64, 128, 256) if p <= a.max_exec_p]
    names = set(a.only.split(",")) if a.only else None
    try:
        res = C.sweep(a.n, a.density, _seconds(a.alpha), _seconds(a.beta), pred_ps, exec_ps, names)
    except ValueError as e:
        print(f"sparsync simulate: error: {e}", file=sys.stderr)
        return 2
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
        prof = S.profile_model(a.model, a.batch, a.image, steps=a.steps, device=a.device)
    except ValueError as e:
        print(f"sparsync simulate: error: {e}", file=sys.stderr)
        return 2
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
        print(f"sparsync simulate: error: {e}", file=sys.stderr)
        return 2
    algos = a.algorithm or ["ring", "dbtree"]
    alpha = _seconds(a.alpha) if a.alpha else None
    beta = _seconds(a.beta) if a.beta else None
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
