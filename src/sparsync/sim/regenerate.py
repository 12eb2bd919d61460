"""Regenerate every committed model-based simulation output, or check that the committed ones match.

::

    python -m sparsync.sim.regenerate            # rewrite docs/img/sim_collectives.* and sim_schedule_*.*
    python -m sparsync.sim.regenerate --check    # exit 1 when a committed number differs from the code

Why: the figures and the numbers quoted from them (``docs/reproduction.md``, ``docs/simulator.md``)
went stale when formulas changed. Everything here is deterministic — alpha-beta formulas, the
virtual-clock executed simulation with seeded inputs, and the MG-WFBP trace simulation of the
committed backward profiles (``docs/img/profile_*_cpu.json``) — so the committed JSON must equal what
the current code computes; ``tests/test_sim_regenerate.py`` runs the check in CI (the executed
simulation only for the small ``P`` where it is quick).

Parameters are fixed here (:data:`COLLECTIVES`, :data:`SCHEDULE_PROFILES`) so that the command and the
check cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import collectives as C

#: the collectives figure: n, density (k = 512: divisible by every P' <= 512, see
#: ``collectives._balanced_indices``), alpha, beta, formula P's, executed P's
COLLECTIVES = {"n": 1 << 16, "density": 512 / (1 << 16), "alpha": C.ALPHA, "beta": C.BETA,
               "pred_ps": [2 ** i for i in range(1, 13)], "exec_ps": [2, 4, 8, 16]}
#: backward profiles measured once under the bench lock (``sparsync simulate profile``), committed
SCHEDULE_PROFILES = ["resnet50", "resnet152", "digits-mlp"]
#: the executed simulation re-run by the CI check (larger P are in the committed JSON, checked by
#: ``python -m sparsync.sim.regenerate --check``)
CHECK_EXEC_PS = (2, 4)


def collectives_result(exec_ps=None, progress=None) -> dict:
    p = COLLECTIVES
    return C.sweep(p["n"], p["density"], p["alpha"], p["beta"], p["pred_ps"],
                   p["exec_ps"] if exec_ps is None else list(exec_ps), progress=progress or (lambda *_: None))


def schedule_result(profile_path: Path) -> dict:
    from . import schedule as S

    prof = S.load_profile(profile_path)
    dump = {"profile": {k: prof[k] for k in prof if k not in ("t_b", "sizes", "order")}}
    for alg in ("ring", "dbtree"):
        Ns = [2 ** i for i in range(2, 12)] if alg == "ring" else [2 ** i for i in range(7, 12)]
        dump[alg] = S.simulate(prof, Ns, alg, None, None)
    return dump


def _json_equal(a, b) -> bool:
    return json.loads(json.dumps(a)) == json.loads(json.dumps(b))


def check(img: Path, exec_ps=CHECK_EXEC_PS) -> list[str]:
    """Differences between the committed outputs under ``img`` and the current code (empty: none)."""
    bad = []
    committed = json.loads((img / "sim_collectives.json").read_text())
    fresh = collectives_result(exec_ps=exec_ps)
    for key in ("n", "density", "alpha", "beta", "predicted"):
        if not _json_equal(committed[key], fresh[key]):
            bad.append(f"sim_collectives.json: {key!r} differs from the code")
    old = {(r["algo"], r["kind"], r["P"]): r for r in committed["executed"]}
    for r in fresh["executed"]:
        if not _json_equal(old.get((r["algo"], r["kind"], r["P"])), r):
            bad.append(f"sim_collectives.json: executed {r['algo']} P={r['P']} differs from the code")
    for name in SCHEDULE_PROFILES:
        got = schedule_result(img / f"profile_{name}_cpu.json")
        if not _json_equal(json.loads((img / f"sim_schedule_{name}.json").read_text()), got):
            bad.append(f"sim_schedule_{name}.json differs from the code")
    return bad


def regenerate(img: Path) -> None:
    from . import schedule as S

    res = collectives_result(progress=print)
    (img / "sim_collectives.json").write_text(json.dumps(res, indent=1))
    C.plot(res, img / "sim_collectives.png")
    for name in SCHEDULE_PROFILES:
        dump = schedule_result(img / f"profile_{name}_cpu.json")
        (img / f"sim_schedule_{name}.json").write_text(json.dumps(dump, indent=1))
        panels = {f"{name}, {alg} all-reduce": dump[alg] for alg in ("ring", "dbtree")}
        S.plot_speedup(panels, img / f"sim_schedule_{name}.png",
                       f"MG-WFBP trace simulation: {name} profile measured on {dump['profile'].get('device')} "
                       f"(batch {dump['profile'].get('batch')}), a,b from the paper's K80/10GbE fit")
        print(f"wrote {img / f'sim_schedule_{name}.json'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync.sim.regenerate", description=__doc__.split("\n")[0])
    ap.add_argument("--img", default="docs/img", help="directory of the committed outputs")
    ap.add_argument("--check", action="store_true", help="compare instead of writing (all executed P)")
    a = ap.parse_args(argv)
    img = Path(a.img)
    if a.check:
        bad = check(img, exec_ps=COLLECTIVES["exec_ps"])
        for b in bad:
            print(b, file=sys.stderr)
        print("all committed simulation outputs match the code" if not bad else f"{len(bad)} differences")
        return 1 if bad else 0
    regenerate(img)
    return 0


if __name__ == "__main__":
    sys.exit(main())
