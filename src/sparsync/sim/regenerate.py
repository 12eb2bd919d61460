"""Regenerate every committed model-based simulation output, or check that the committed ones match.

::

    python -m sparsync.sim.regenerate            # rewrite docs/img/sim_collectives.* and sim_schedule_*.*
    python -m sparsync.sim.regenerate --check    # exit 1 when a committed number differs from the code
    python -m sparsync.sim.regenerate --rows     # the model numbers quoted in docs/reproduction.md

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


def _t(name: str, kind: str, P: int, n: int, density: float, alpha: float, beta: float) -> tuple[float, float]:
    return C.predicted_time(C.predicted(C.Algo(name, kind), P, n, density), alpha, beta)


def _ms(t: tuple[float, float]) -> str:
    lo, hi = (1e3 * x for x in t)
    return f"{hi:.2f}" if lo == hi else f"{lo:.2f}-{hi:.2f}"


def reproduction_rows() -> list[str]:
    """The model numbers quoted in ``docs/reproduction.md`` (formulas only; deterministic), one line each."""
    out = []
    a, b = 10e-6, 0.8e-9  # SparCML row 1: a faster network than ours, as in the thesis' figures
    for P in (8, 64):
        cells = [f"{d:g}: rec_dbl {_ms(_t('ssar_rec_dbl', 'collective', P, 1 << 24, d, a, b))} / split "
                 f"{_ms(_t('ssar_split_allgather', 'collective', P, 1 << 24, d, a, b))} ms"
                 for d in (1e-5, 1e-4, 1e-3, 1e-2)]
        out.append(f"sparcml 1, N=2^24, alpha 10us, beta 0.8ns/B, P={P}: " + "; ".join(cells))
    for P in (8, 64):
        cells = [f"{d:g}: dsar_split {_ms(_t('dsar_split_allgather', 'collective', P, 1 << 24, d, C.ALPHA, C.BETA))}"
                 f" / rec_dbl {_ms(_t('ssar_rec_dbl', 'collective', P, 1 << 24, d, C.ALPHA, C.BETA))} ms"
                 for d in (1e-3, 1e-2, 5e-2, 1e-1)]
        out.append(f"sparcml 2, N=2^24, P={P}: " + "; ".join(cells))
    n, d = COLLECTIVES["n"], COLLECTIVES["density"]
    for P in (16, 128, 256):
        out.append(f"sparcml 3, n={n}, k=512, P={P}: dsar_early_switch "
                   f"{_ms(_t('dsar_early_switch', 'collective', P, n, d, C.ALPHA, C.BETA))} vs dsar_split_allgather "
                   f"{_ms(_t('dsar_split_allgather', 'collective', P, n, d, C.ALPHA, C.BETA))} ms")
    def ms(name, kind, P, n, d):  # formula time on our default network (alpha 50 us, 1 Gbit/s)
        return _ms(_t(name, kind, P, n, d, C.ALPHA, C.BETA))

    ratios = [(_t("auto", "collective", P, n, d, C.ALPHA, C.BETA)[1]
               / _t("dense", "reducer", P, n, 1.0, C.ALPHA, C.BETA)[1], P) for P in COLLECTIVES["pred_ps"]]
    worst = max(ratios)
    out.append(f"sparcml 4, n={n}, k=512: auto (upper bound) / dense, worst over P = 2..4096: "
               f"{worst[0]:.3f} at P={worst[1]}")
    n14 = 14_700_000
    out.append(f"spardl 1, n=14.7M, 1%, P=14: spardl {ms('spardl', 'reducer', 14, n14, 0.01)}, "
               f"TopkA (allgather) {ms('allgather', 'collective', 14, n14, 0.01)}, "
               f"topkdsa {ms('topkdsa', 'reducer', 14, n14, 0.01)}, "
               f"oktopk (code's bounds) {ms('oktopk', 'reducer', 14, n14, 0.01)} ms")
    n16 = 16_800_000
    out.append("spardl 4, n=16.8M, 1%: " + "; ".join(
        f"P={P}: spardl {ms('spardl', 'reducer', P, n16, 0.01)}, TopkA {ms('allgather', 'collective', P, n16, 0.01)}, "
        f"gtopk {ms('gtopk', 'reducer', P, n16, 0.01)}, micro {ms('micro', 'reducer', P, n16, 0.01)} ms"
        for P in (16, 256, 4096)))
    n8 = (8 << 20) // 4
    ag = _t("allgather", "collective", 16, n8, 1.0, C.ALPHA, C.BETA)[1]
    ar = _t("dense", "reducer", 16, n8, 1.0, C.ALPHA, C.BETA)[1]
    out.append(f"s2 4, ring P=16, 8 MiB: all-gather {ag:.3f} s vs all-reduce {ar:.3f} s = {ag / ar:.2f}x")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync.sim.regenerate", description=__doc__.split("\n")[0])
    ap.add_argument("--img", default="docs/img", help="directory of the committed outputs")
    ap.add_argument("--check", action="store_true", help="compare instead of writing (all executed P)")
    ap.add_argument("--rows", action="store_true", help="print the model numbers quoted in docs/reproduction.md")
    a = ap.parse_args(argv)
    img = Path(a.img)
    if a.rows:
        print("\n".join(reproduction_rows()))
        return 0
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
