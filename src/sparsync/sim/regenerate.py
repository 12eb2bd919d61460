"""Regenerate every committed model-based simulation output, or check that the committed ones and the
model numbers the docs quote match the code.

::

    python -m sparsync.sim.regenerate            # rewrite docs/img/sim_collectives.* and sim_schedule_*.*
    python -m sparsync.sim.regenerate --check    # exit 1 when a committed or quoted number differs from the code
    python -m sparsync.sim.regenerate --rows     # the model numbers docs/reproduction.md may quote, by key

Why: the figures and the numbers quoted from them (``docs/reproduction.md``, ``docs/simulator.md``)
went stale when formulas changed. Everything here is deterministic — alpha-beta formulas, the
virtual-clock executed simulation with seeded inputs, and the MG-WFBP trace simulation of the
committed backward profiles (``docs/img/profile_*_cpu.json``) — so the committed JSON must equal what
the current code computes; ``tests/sim/test_sim_regenerate.py`` runs the check in CI (the executed
simulation only for the small ``P`` where it is quick).

**Quoted model numbers.** Every model number in ``docs/reproduction.md`` — a time, bound, ratio, speed-up,
group count or crossing computed by the alpha-beta formulas (SparCML, SparDL, S2 rows) or read from the
MG-WFBP trace simulation — must carry an invisible key right after its digits, e.g.
``20.56<!--m:spardl4.P16.spardl--> ms`` (a range ``lo–hi`` is one value). :func:`model_numbers` gives
the value of every key, formatted as the doc quotes it; ``--rows`` prints them grouped by key prefix
(``prefix: leaf value``, the key being ``prefix.leaf``); ``--check`` (:func:`check_doc`) compares each
keyed number with it and reports a differing value or an unknown key as one line naming the key. Inputs
(``P``, ``n``, density, alpha, beta) and measured numbers carry no key. The schedule numbers are read from
the committed ``sim_schedule_<model>.json`` (fast), whose equality with the code :func:`check` verifies.

Parameters are fixed here (:data:`COLLECTIVES`, :data:`SCHEDULE_PROFILES`) so that the command and the
check cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import re
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


def _formula_numbers() -> dict[str, str]:
    """The alpha-beta formula numbers quoted in ``docs/reproduction.md`` (milliseconds unless the key says)."""
    out: dict[str, str] = {}
    a, b = 10e-6, 0.8e-9  # SparCML row 1: a faster network than ours, as in the thesis' figures
    for P in (8, 64):
        for d in (1e-5, 1e-4, 1e-3, 1e-2):
            for short, name in (("rec_dbl", "ssar_rec_dbl"), ("split", "ssar_split_allgather")):
                out[f"sparcml1.P{P}.d{d:g}.{short}"] = _ms(_t(name, "collective", P, 1 << 24, d, a, b))

    def ms(name, kind, P, n, d):  # formula time on our default network (alpha 50 us, 1 Gbit/s)
        return _ms(_t(name, kind, P, n, d, C.ALPHA, C.BETA))

    for P in (8, 64):
        for d in (1e-3, 1e-2, 5e-2, 1e-1):
            out[f"sparcml2.P{P}.d{d:g}.dsar_split"] = ms("dsar_split_allgather", "collective", P, 1 << 24, d)
            out[f"sparcml2.P{P}.d{d:g}.rec_dbl"] = ms("ssar_rec_dbl", "collective", P, 1 << 24, d)
    n, d = COLLECTIVES["n"], COLLECTIVES["density"]
    for P in (16, 128, 256):
        out[f"sparcml3.P{P}.early_switch"] = ms("dsar_early_switch", "collective", P, n, d)
        out[f"sparcml3.P{P}.dsar_split"] = ms("dsar_split_allgather", "collective", P, n, d)
    ratios = [(_t("auto", "collective", P, n, d, C.ALPHA, C.BETA)[1]
               / _t("dense", "reducer", P, n, 1.0, C.ALPHA, C.BETA)[1], P) for P in COLLECTIVES["pred_ps"]]
    worst = max(ratios)
    out["sparcml4.auto_over_dense.worst"] = f"{worst[0]:.2f}"
    out["sparcml4.auto_over_dense.worst_P"] = str(worst[1])
    n14 = 14_700_000
    for short, name, kind in (("spardl", "spardl", "reducer"), ("topka", "allgather", "collective"),
                              ("topkdsa", "topkdsa", "reducer"), ("oktopk", "oktopk", "reducer")):
        out[f"spardl1.P14.{short}"] = ms(name, kind, 14, n14, 0.01)
    topka, spardl = (_t(name, kind, 14, n14, 0.01, C.ALPHA, C.BETA)[1]
                     for name, kind in (("allgather", "collective"), ("spardl", "reducer")))
    out["spardl1.P14.topka_over_spardl"] = f"{topka / spardl:.1f}"
    n16 = 16_800_000
    for P in (16, 256, 4096):
        for short, name, kind in (("spardl", "spardl", "reducer"), ("topka", "allgather", "collective"),
                                  ("gtopk", "gtopk", "reducer"), ("micro", "micro", "reducer")):
            out[f"spardl4.P{P}.{short}"] = ms(name, kind, P, n16, 0.01)
    n8 = (8 << 20) // 4
    ag = _t("allgather", "collective", 16, n8, 1.0, C.ALPHA, C.BETA)[1]
    ar = _t("dense", "reducer", 16, n8, 1.0, C.ALPHA, C.BETA)[1]
    out["s2_4.P16.allgather_s"], out["s2_4.P16.allreduce_s"] = f"{ag:.3f}", f"{ar:.3f}"
    out["s2_4.P16.ratio"] = f"{ag / ar:.2f}"
    return out


def _schedule_numbers(img: Path) -> dict[str, str]:
    """The MG-WFBP trace-simulation numbers quoted in ``docs/reproduction.md``, read from the committed
    ``sim_schedule_<model>.json`` (which :func:`check` compares with the code): every speed-up and group
    count, the ratios and crossings the doc quotes."""
    out: dict[str, str] = {}
    speed: dict[tuple, float] = {}
    for name in ("resnet50", "resnet152"):
        dump = json.loads((img / f"sim_schedule_{name}.json").read_text())
        for alg in ("ring", "dbtree"):
            for r in dump[alg]:
                at = f"sched.{name}.{alg}.N{r['N']}"
                speed[(name, alg, r["N"], r["strategy"])] = r["speedup"]
                out[f"{at}.{r['strategy']}"] = f"{r['speedup']:.2f}"
                out[f"{at}.groups.{r['strategy']}"] = str(r["groups"])
        ring = sorted({k[2] for k in speed if k[:2] == (name, "ring")})
        # the largest ring size at which WFBP still beats one message, and the next (the curves cross between)
        lo = max(N for N in ring if speed[(name, "ring", N, "wfbp")] > speed[(name, "ring", N, "single")])
        out[f"sched.{name}.ring.wfbp_single_cross.lo"] = str(lo)
        out[f"sched.{name}.ring.wfbp_single_cross.hi"] = str(ring[ring.index(lo) + 1])
        out[f"sched.{name}.ring.one_message_from"] = str(min(
            N for N in ring if out[f"sched.{name}.ring.N{N}.groups.mgwfbp"] == "1"))
    for name, N in (("resnet50", 16), ("resnet50", 64), ("resnet152", 64)):
        for base in ("wfbp", "single"):
            out[f"sched.{name}.ring.N{N}.mgwfbp_over_{base}"] = (
                f"{speed[(name, 'ring', N, 'mgwfbp')] / speed[(name, 'ring', N, base)]:.2f}")
    for name, N in (("resnet50", 64), ("resnet50", 256), ("resnet152", 64)):
        gain = speed[(name, "ring", N, "optimal")] / speed[(name, "ring", N, "mgwfbp")] - 1
        out[f"sched.{name}.ring.N{N}.optimal_gain_pct"] = f"{100 * gain:.0f}"
    return out


def model_numbers(img: Path | str = "docs/img") -> dict[str, str]:
    """Every model number ``docs/reproduction.md`` quotes, formatted as quoted, by key (see the module doc)."""
    return {**_formula_numbers(), **_schedule_numbers(Path(img))}


def rows(numbers: dict[str, str]) -> list[str]:
    """``--rows``: the numbers grouped by key prefix, one line per group (``prefix: leaf value, ...``)."""
    groups: dict[str, list[str]] = {}
    for key, value in numbers.items():
        prefix, _, leaf = key.rpartition(".")
        groups.setdefault(prefix, []).append(f"{leaf} {value}")
    return [f"{prefix}: " + ", ".join(cells) for prefix, cells in groups.items()]


#: a quoted model number: digits (a range ``lo-hi`` or ``lo–hi``) right before ``<!--m:key-->``
_QUOTED = re.compile(r"(\d[\d.]*(?:[-\u2013]\d[\d.]*)?)$")
_KEY = re.compile(r"<!--m:([^>]*?)-->")


def check_doc(doc: Path, img: Path | str = "docs/img") -> list[str]:
    """Differences between the model numbers quoted in ``doc`` and :func:`model_numbers` (empty: none)."""
    numbers = model_numbers(img)
    text = doc.read_text()
    bad = []
    for m in _KEY.finditer(text):
        key, line = m.group(1), text.count("\n", 0, m.start()) + 1
        quoted = _QUOTED.search(text, max(0, m.start() - 40), m.start())
        if key not in numbers:
            bad.append(f"{doc}:{line}: unknown model key {key!r}")
        elif quoted is None:
            bad.append(f"{doc}:{line}: key {key!r} follows no number")
        elif quoted.group(1).replace("\u2013", "-") != numbers[key]:
            bad.append(f"{doc}:{line}: {key} quotes {quoted.group(1)}, the code computes {numbers[key]}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsync.sim.regenerate", description=__doc__.split("\n")[0])
    ap.add_argument("--img", default="docs/img", help="directory of the committed outputs")
    ap.add_argument("--doc", default="docs/reproduction.md",
                    help="the document whose keyed model numbers --check compares")
    ap.add_argument("--check", action="store_true",
                    help="compare instead of writing (all executed P, and every keyed number of --doc)")
    ap.add_argument("--rows", action="store_true",
                    help="print the keyed model numbers docs/reproduction.md may quote ('prefix: leaf value')")
    a = ap.parse_args(argv)
    img = Path(a.img)
    if a.rows:
        print("\n".join(rows(model_numbers(img))))
        return 0
    if a.check:
        doc = Path(a.doc)
        if not doc.is_file():
            print(f"--doc {doc}: no such file", file=sys.stderr)
            return 2
        bad = check_doc(doc, img) + check(img, exec_ps=COLLECTIVES["exec_ps"])
        for b in bad:
            print(b, file=sys.stderr)
        print("all committed simulation outputs and quoted model numbers match the code" if not bad
              else f"{len(bad)} differences")
        return 1 if bad else 0
    regenerate(img)
    return 0


if __name__ == "__main__":
    sys.exit(main())
