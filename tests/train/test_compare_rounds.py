"""Repeated, interleaved comparisons: round-robin order, bootstrap intervals, paired ratios, the
floor, "not decided" verdicts, and time to target interpolated between evaluations."""

import json
import math
import random

import pytest

from sparsync.cli import main
from sparsync.train.stats import crossing, decide, interval, median, paired_ratios


# ------------------------------------------------------------------------------------------ statistics
def test_interval_contains_median_and_is_reproducible():
    rng = random.Random(1)
    for n in (1, 2, 3, 5, 8, 20):
        for _ in range(20):
            v = [rng.lognormvariate(0, 0.5) for _ in range(n)]
            iv = interval(v)
            assert iv.lo <= iv.mid <= iv.hi and iv.mid == median(v) and iv.n == n
            assert min(v) <= iv.lo and iv.hi <= max(v)
            assert interval(v) == iv  # fixed bootstrap seed: the same runs give the same report
    # with 3 runs every end value is the median of > 2.5 % of the resamples: the interval is the range
    assert tuple(interval([3.0, 1.0, 2.0]))[:3] == (2.0, 1.0, 3.0)
    # 20 values: the 95 % interval of the median is strictly inside the range
    v = list(range(20))
    iv = interval(v)
    assert 0 < iv.lo < iv.mid < iv.hi < 19


def test_not_reached_is_infinite():
    iv = interval([1.0, None, 2.0])
    assert iv.mid == 2.0 and math.isinf(iv.hi) and iv.format() == "2.00 [1.00, not reached]"
    assert iv.to_dict()["high"] is None
    assert math.isinf(interval([None, None]).mid)


def test_ratios_are_paired_per_round():
    # the machine was slow in round 1: both rows took twice as long. Per round the row is always
    # 0.5x the baseline; unpaired medians would say 0.5 too, but their ranges would mix rounds
    row = {0: 1.0, 1: 2.0, 2: 1.1}
    base = {0: 2.0, 1: 4.0, 2: 2.2}
    r = paired_ratios(row, base)
    assert r == pytest.approx([0.5, 0.5, 0.5])
    iv = interval(r)
    assert iv.lo == pytest.approx(0.5) and iv.hi == pytest.approx(0.5)
    # a round one of them lacks is left out; a baseline that never reached: the row is infinitely faster
    assert paired_ratios({0: 1.0, 1: 1.0}, {0: 2.0}) == [0.5]
    assert paired_ratios({0: 1.0, 1: None}, {0: None, 1: None}) == [0.0]
    assert paired_ratios({0: None}, {0: 2.0}) == [math.inf]


def test_decide_straddle():
    assert decide(interval([0.3, 0.4, 0.45]), 0.5) == "yes"
    assert decide(interval([0.55, 0.6, 0.7]), 0.5) == "no"
    assert decide(interval([0.4, 0.45, 0.6]), 0.5) == "not decided"
    assert decide(interval([0.4, 0.45, 0.6]), 0.3, at_most=False) == "yes"
    assert decide(None, 0.5) == "not decided"


# ------------------------------------------------------------------------------- time to target
def _curve(f, every, steps, dt=0.1, metric="accuracy"):
    """Evaluations of ``f(steps done)`` every ``every`` steps, each step taking ``dt`` seconds."""
    return [{"step": s - 1, "time_s": dt * s, metric: f(s)} for s in range(every, steps + 1, every)]


def test_crossing_interpolates_between_evaluations():
    lin = lambda s: 0.1 + 0.01 * s  # reaches 0.95 after exactly 85 steps
    for every in (1, 2, 5, 7):
        c = crossing(_curve(lin, every, 120), 0.95)
        assert c["steps"] == pytest.approx(85.0) and c["time_s"] == pytest.approx(8.5)
        # the first evaluation at or past the target is on the grid, at or after the crossing
        assert c["eval_steps"] >= 85 and c["eval_steps"] - 85 < every and c["eval_steps"] % every == 0
    # a loss reaches its target going down (direction from the metric's name)
    loss = lambda s: 2.0 - 0.02 * s  # <= 1.0 after 50 steps
    c = crossing(_curve(loss, 3, 90, metric="loss"), 1.0, metric="loss")
    assert c["steps"] == pytest.approx(50.0) and c["time_s"] == pytest.approx(5.0)
    assert crossing(_curve(lin, 5, 50), 0.95) is None  # never reached
    first = crossing(_curve(lin, 5, 120), 0.1)  # reached at the first evaluation: nothing before it
    assert first["steps"] == first["eval_steps"] == 5
    # a noisy curve: the FIRST crossing counts, interpolated from the evaluation just before it
    ev = [{"step": 1, "time_s": 1.0, "accuracy": 0.90}, {"step": 3, "time_s": 2.0, "accuracy": 0.96},
          {"step": 5, "time_s": 3.0, "accuracy": 0.94}, {"step": 7, "time_s": 4.0, "accuracy": 0.97}]
    c = crossing(ev, 0.95)
    assert c["time_s"] == pytest.approx(1.0 + 5 / 6) and c["steps"] == pytest.approx(2 + 2 * 5 / 6)


# ------------------------------------------------------------------------------------------ the floor
def _run(reducer, rnd, step, compute=None, tt=None, acc=0.97, label=None):
    return {"reducer": reducer, "label": label or reducer, "name": label or reducer, "config": label or reducer,
            "round": rnd, "median_step_s": step, "median_compute_s": compute, "time_to_target_s": tt,
            "steps_to_target": None if tt is None else 40.0, "final_accuracy": acc}


def test_no_row_comes_out_below_the_floor():
    from sparsync.train.report import aggregate, floors, table_rows

    # the situation of a loaded 2-core machine: the no-communication row (4 ranks computing at once)
    # is slower than a communicating row's step, whose own compute is far less
    runs = [_run("nocomm", 0, 0.0909, 0.0909), _run("micro", 0, 0.0672, 0.0333), _run("ddp", 0, 0.25)]
    assert floors(runs) == {0: 0.0333}
    by = {a["reducer"]: a for a in aggregate(runs)}
    assert by["micro"]["x_floor"].mid == pytest.approx(0.0672 / 0.0333) and by["nocomm"]["x_floor"].mid > 1
    # the property, over random rounds: every row, every round, at or above its round's floor
    rng = random.Random(0)
    runs = []
    for rnd in range(6):
        for r in ("nocomm", "dense", "ddp", "ddp-fp16", "micro", "topka"):
            step = rng.uniform(0.02, 0.4)
            comp = None if r.startswith("ddp") else (step if r == "nocomm" else step * rng.uniform(0.2, 1.1))
            runs.append(_run(r, rnd, step, comp))
    fl = floors(runs)
    for s in runs:
        assert s["median_step_s"] / fl[s["round"]] >= 1.0
    for a in aggregate(runs):
        assert a["x_floor"].lo >= 1.0
    assert all(not r["x_floor"].startswith("0.") for r in table_rows(runs))


# ------------------------------------------------------------------------------------------ verdict
def test_verdict_prints_intervals_and_not_decided():
    from sparsync.commands.run_default import verdict

    def rounds(fp16_tts, sparse_tts):
        out = []
        for k, (b, t) in enumerate(zip(fp16_tts, sparse_tts)):
            out += [_run("nocomm", k, 0.06, 0.06, 5.0, 0.95), _run("dense", k, 0.3, 0.06, 12.0),
                    _run("ddp", k, 0.29, None, 11.0), _run("ddp-fp16", k, 0.2, None, b),
                    _run("ddp-powersgd1", k, 0.1, None, 9.0),
                    _run("micro", k, 0.08, 0.06, t, 0.968, label="micro 0.02 (single)")]
        return out

    # per round the sparse row is 0.4x, 0.45x, 0.6x DDP + fp16: the interval straddles the goal 0.5
    out = verdict(rounds([10.0, 10.0, 10.0], [4.0, 4.5, 6.0]))
    assert out.startswith("goal NOT DECIDED") and "over 3 rounds" in out
    assert "[??] not decided: time to target 0.45 [0.40, 0.60]x torch DDP + fp16" in out
    # a slow round that hits both rows alike does not widen the paired interval
    out = verdict(rounds([10.0, 20.0, 10.0], [4.0, 8.0, 4.4]))
    assert out.startswith("goal MET") and "[ok] time to target 0.40 [0.40, 0.44]x" in out
    out = verdict(rounds([10.0, 10.0, 10.0], [6.0, 7.0, 5.5]))
    assert out.startswith("goal NOT met") and "[NO] time to target 0.60 [0.55, 0.70]x" in out
    assert "[ok] faster than ddp-powersgd1" in out and "points above dense" not in out


# ------------------------------------------------------------------------------- a real comparison
def test_compare_rounds_run_round_robin_and_resume(tmp_path, capsys):
    from sparsync.commands.compare import rounds_of
    from sparsync.train import load_runs

    assert rounds_of(2, 2, 5) == [(0, 5), (0, 6), (1, 5), (1, 6)]
    argv = ["compare", "--thread", "--no-baselines", "--configs", "dense;topka:0.05", "--workload", "digits-mlp",
            "--workload-option", "width=32", "--workload-option", "n_test=1024", "--steps", "6", "--eval-every", "2",
            "--workers", "2", "--target-accuracy", "0.2", "--runs-dir", str(tmp_path), "--name", "cmp",
            "--no-progress", "--repeats", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    launched = [line.split("): ", 1)[1].split(" on ")[0] for line in out.splitlines() if line.startswith("[")]
    assert launched == ["dense (single)", "topka 0.05 (single)"] * 2  # A B, A B
    root = tmp_path / "cmp"
    runs = load_runs(root)
    assert sorted((r["config"], r["round"], r["repeat"], r["seed"]) for r in runs) == [
        ("dense-single", 0, 0, 0), ("dense-single", 1, 1, 0), ("topka-0.05-single", 0, 0, 0),
        ("topka-0.05-single", 1, 1, 0)]
    for r in runs:  # every repeat's run kept in its own directory
        assert r["path"].endswith(f"r{r['repeat']}-s0") and r["n_heldout"] == 1024 and r["eval_every"] == 2
        if r["time_to_target_s"] is not None:  # interpolated: never after the first evaluation that reached it
            assert r["time_to_target_s"] <= r["time_to_target_eval_s"]
            assert 0 < r["steps_to_target"] <= 6
    # speed-ups are paired with dense of the same round
    for r in runs:
        d = next(x for x in runs if x["reducer"] == "dense" and x["round"] == r["round"])
        assert r["speedup_step"] == pytest.approx(d["median_step_s"] / r["median_step_s"])
    js = json.loads((root / "comparison.json").read_text())
    step = js["rows"][0]["step_s"]
    assert [x["n"] for x in js["rows"]] == [2, 2] and step["low"] <= step["median"] <= step["high"]
    md = (root / "report.md").read_text()
    assert "2 rounds" in md and "## Every run" in md and "round's floor ms" in md
    for f in ("accuracy_vs_time.png", "time_to_target.png", "step_breakdown.png"):
        assert (root / f).stat().st_size > 1000
    # an interrupted comparison: one run lost; --resume keeps the other three and runs that one again
    lost = root / "topka-0.05-single" / "r1-s0" / "summary.json"
    lost.unlink()
    keep = (root / "dense-single" / "r1-s0" / "summary.json").read_text()
    assert main(argv + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert out.count("finished before, kept") == 3 and lost.exists()
    assert (root / "dense-single" / "r1-s0" / "summary.json").read_text() == keep


def test_rounds_flags_refuse_bad_values(tmp_path, capsys):
    for argv in (["compare", "--repeats", "0"], ["compare", "--seeds", "0"], ["run-default", "--seeds", "0"]):
        assert main(argv + ["--runs-dir", str(tmp_path)]) == 2
        assert "positive integer" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
