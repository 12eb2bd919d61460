"""Bad input to `sparsync train` / `compare` gets clear messages, and `compare` writes its report."""

import os

import pytest

from sparsync.cli import main
from sparsync.commands.compare import config_slug, parse_configs


def _err(capsys, argv):
    code = main(argv)
    return code, capsys.readouterr().err


def test_unknown_names_list_valid_ones(tmp_path, capsys):
    code, err = _err(capsys, ["train", "--workload", "imagenet", "--runs-dir", str(tmp_path)])
    assert code == 2 and "unknown workload 'imagenet'" in err and "digits-mlp" in err and "lm" in err
    code, err = _err(capsys, ["train", "--reducer", "nope", "--runs-dir", str(tmp_path)])
    assert code == 2 and "unknown reducer 'nope'" in err and "dense" in err and "ddp-fp16" in err
    code, err = _err(capsys, ["compare", "--configs", "dense;bogus:0.1", "--runs-dir", str(tmp_path)])
    assert code == 2 and "unknown reducer 'bogus'" in err
    code, err = _err(capsys, ["train", "--density", "2", "--runs-dir", str(tmp_path)])
    assert code == 2 and "density" in err
    assert not any(tmp_path.iterdir())  # nothing was created for invalid input


def test_bandwidth_without_root_says_how(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code, err = _err(capsys, ["train", "--bandwidth", "1gbit", "--runs-dir", str(tmp_path)])
    assert code == 2 and "needs root" in err and "sudo" in err and "--loopback" in err


def test_parse_configs():
    cs = parse_configs("dense; micro:0.02,merge=buckets:25 ;s2,rows=3", 0.01, "single")
    assert [c["reducer"] for c in cs] == ["dense", "micro", "s2"]
    assert cs[1]["density"] == 0.02 and cs[1]["merge"] == "buckets:25" and cs[2]["options"] == {"rows": 3}
    assert config_slug(cs[1]) == "micro-0.02-buckets25"
    with pytest.raises(ValueError, match="not a number"):
        parse_configs("micro:x", 0.01, "single")


def test_compare_writes_report_and_refuses_overwrite(tmp_path, capsys):
    argv = ["compare", "--thread", "--no-baselines", "--configs", "dense;topka:0.05", "--workload", "digits-mlp",
            "--workload-option", "width=64", "--steps", "6", "--eval-every", "3", "--workers", "2",
            "--runs-dir", str(tmp_path), "--name", "cmp", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dense (single)" in out and "topka 0.05 (single)" in out and "report:" in out
    root = tmp_path / "cmp"
    for f in ("report.md", "accuracy_vs_time.png", "step_breakdown.png", "bytes_per_step.png", "density.png"):
        assert (root / f).stat().st_size > 0, f
    md = (root / "report.md").read_text()
    assert "time to target" in md and "topka 0.05" in md
    assert (root / "dense-single" / "summary.json").exists()
    code, err = _err(capsys, argv)
    assert code == 2 and "--force" in err


def test_run_default_verdict_and_choice():
    from sparsync.commands.compare import parse_configs
    from sparsync.commands.run_default import DEFAULT_SPARSE, verdict
    from sparsync.reducers.registry import load_all

    for c in parse_configs(";".join(DEFAULT_SPARSE), 0.01, "single"):
        assert c["reducer"] in load_all() and 0 < c["density"] <= 1
    row = lambda r, tt, acc=0.97, step=0.1: {"reducer": r, "label": r, "time_to_target_s": tt,
                                             "final_accuracy": acc, "median_step_s": step}
    base = [row("nocomm", 20.0, 0.8, 0.06), row("dense", 12.0, 0.97, 0.3), row("ddp", 10.0, 0.97, 0.28),
            row("ddp-fp16", 8.0, 0.97, 0.2), row("ddp-powersgd1", 9.0, 0.9, 0.1), row("ddp-powersgd4", None)]
    fast = row("micro", 3.9, 0.966, 0.08)
    assert verdict(base + [fast, row("s2", 6.0)]).startswith("goal MET")
    out = verdict(base + [{**fast, "final_accuracy": 0.96}])  # 1 point worse than dense
    assert out.startswith("goal NOT met") and "[NO] final accuracy 1.00 points below dense" in out
    assert "[ok] final accuracy 0.30 points above dense" in verdict(base + [{**fast, "final_accuracy": 0.973}])
    assert "[NO] step 1.50x" not in verdict(base + [{**fast, "median_step_s": 0.09}])  # 1.5x is allowed
    assert "[NO] step 1.67x" in verdict(base + [{**fast, "median_step_s": 0.1}])
    assert "[NO] time to target 0.62x" in verdict(base + [{**fast, "time_to_target_s": 5.0}])
    assert "NOT faster than ddp-powersgd1" in verdict(base + [{**fast, "time_to_target_s": 9.5}])
    assert "no sparse configuration" in verdict(base + [row("s2", None)])
    assert "cannot judge" in verdict(base[:2] + [fast])
    # a faster row that ends 2 points below dense is not the best one; the accurate one is judged
    out = verdict(base + [{**fast, "label": "sloppy", "time_to_target_s": 3.0, "final_accuracy": 0.95}, fast])
    assert "best sparsync row micro reached the target in 3.90 s" in out and out.startswith("goal MET")
    out = verdict(base + [{**fast, "final_accuracy": 0.95}])  # none within 0.5 points: the fastest, judged
    assert "[NO] final accuracy 2.00 points below dense" in out


def test_stop_at_target_ends_every_rank_at_the_crossing(tmp_path):
    # the same deterministic thread-rank run with and without --stop-at-target: the stopped run ends at
    # the first evaluation at or above the target, with the same steps to target, and writes that many steps
    import json

    base = ["train", "--thread", "--workload", "digits-mlp", "--workload-option", "width=64", "--workers", "2",
            "--reducer", "micro", "--density", "0.05", "--steps", "30", "--eval-every", "3",
            "--target-accuracy", "0.5", "--runs-dir", str(tmp_path), "--no-progress"]
    assert main(base + ["--name", "full"]) == 0
    assert main(base + ["--name", "stop", "--stop-at-target"]) == 0
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    stop = json.loads((tmp_path / "stop" / "summary.json").read_text())
    assert full["stopped_at_target"] is None and full["steps_to_target"] is not None
    first = next(e["step"] + 1 for e in full["evals"] if e["accuracy"] >= 0.5)
    assert first < 30 and stop["stopped_at_target"] == first
    assert stop["steps_to_target"] == full["steps_to_target"]
    lines = (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()
    assert len([ln for ln in lines if '"step"' in ln]) == first
