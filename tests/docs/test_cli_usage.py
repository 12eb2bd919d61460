"""The CLI's contract with its users: one unit rule everywhere, user errors
as one line with exit code 2 and nothing on disk, defaults in every --help, no torch for --help."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparsync import units
from sparsync.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------- units
RATES_OK = [  # spelling, bits per second
    ("1gbit", 1e9), ("100mbit", 1e8), ("500kbit", 5e5), ("2tbit", 2e12), ("1Gbit", 1e9), ("1gbit/s", 1e9),
    ("1Gbit/s", 1e9), ("1 gbit", 1e9), ("1Gb/s", 1e9), ("100Mb/s", 1e8), ("1.5gbit", 1.5e9), ("1mibit", 2**20),
    ("1e9", 1e9), ("1000000000", 1e9), (1e9, 1e9), ("125MB/s", 1e9), ("125MB", 1e9), ("125mbyte/s", 1e9),
    ("125mbytes", 1e9), ("1GB/s", 8e9), ("10kB/s", 8e4),
]
RATES_BAD = ["1gbps", "100Mbps", "1Gbps", "125mbps", "1gb", "1mb", "1g", "fast", "-1gbit", "0", "0gbit",
             "1GB/S", "gbit", ""]


@pytest.mark.parametrize("spelling,bits", RATES_OK)
def test_rate_spellings(spelling, bits):
    assert units.parse_rate(spelling) == pytest.approx(bits)
    assert units.parse_rate(units.format_rate(units.parse_rate(spelling))) == pytest.approx(bits)


@pytest.mark.parametrize("spelling", RATES_BAD)
def test_rate_rejections_show_accepted_forms(spelling):
    with pytest.raises(ValueError, match="accepted: 1gbit"):
        units.parse_rate(spelling)


def test_one_rule_for_cluster_and_cost_model():
    """The bug this module fixes: plan read '1gbps' as 1 Gbit/s, train as 8 Gbit/s."""
    from sparsync.cluster import parse_bandwidth as tc_bits
    from sparsync.schedule.costmodel import parse_bandwidth as cm_bytes

    for spelling, bits in RATES_OK:
        if isinstance(spelling, str):
            assert tc_bits(spelling) == pytest.approx(bits) and cm_bytes(spelling) == pytest.approx(bits / 8)
    for bad in ("1gbps", "100Mbps"):
        for f in (tc_bits, cm_bytes):
            with pytest.raises(ValueError, match="ambiguous"):
                f(bad)


def test_sizes_counts_durations():
    assert units.parse_size("25MB") == 25_000_000 and units.parse_size("25MiB") == 25 * 2**20
    assert units.parse_size("4k") == 4000 and units.parse_size(4096) == 4096 and units.parse_size("1KiB") == 1024
    for bad in ("25mb", "x", "-1"):
        with pytest.raises(ValueError):
            units.parse_size(bad)
    assert units.parse_count("1e7") == 10**7 and units.parse_count("10M") == 10**7 and units.parse_count("2.5k") == 2500
    for bad in ("1.5", "-3", "ten"):
        with pytest.raises(ValueError):
            units.parse_count(bad)
    assert units.parse_duration("50us") == pytest.approx(5e-5) and units.parse_duration("0.2ms") == pytest.approx(2e-4)
    assert units.parse_duration("1e-4") == pytest.approx(1e-4)
    with pytest.raises(ValueError):
        units.parse_duration("fast")


# ------------------------------------------------------------------------------------- user errors
TRAIN_ERRORS = [  # argv (after train/compare), words the one line must contain
    (["train", "--merge", "bogus"], "unknown merge strategy 'bogus'; valid: wfbp"),
    (["train", "--reducer", "micro", "--option", "foo=1"], "unknown options: foo; valid: band"),
    (["train", "--workload-option", "foo=1"], "no option foo; valid: width, depth"),
    (["train", "--ddp-option", "foo=1"], "not a SparseDDP keyword; valid:"),
    (["train", "--reducer", "ddp", "--option", "x=1"], "takes no sparsync reducer"),
    (["train", "--bandwidth", "1gbps"], "ambiguous"),
    (["train", "--bandwidth", "fast"], "accepted: 1gbit"),
    (["train", "--steps", "0"], "positive integer"),
    (["train", "--density", "2"], "density"),
    (["train", "--workload", "imagenet"], "unknown workload 'imagenet'; valid:"),
    (["train", "--reducer", "nope"], "unknown reducer 'nope'; valid:"),
    (["train", "--option", "novalue"], "key=value"),
    (["train", "--nproc-per-node", "4"], "torchrun flag"),
    (["train", "--world-sizes", "4"], "unrecognized"),
    (["compare", "--configs", "micro:0.01,foo=2"], "configuration 'micro': reducer 'micro' got unknown options: foo"),
    (["compare", "--configs", "micro:0.01,merge=nope"], "unknown merge strategy 'nope'"),
    (["compare", "--configs", "dense;bogus:0.1"], "unknown reducer 'bogus'"),
    (["compare", "--configs", "micro:x"], "not a number"),
    (["compare", "--bandwidth", "100Mbps"], "ambiguous"),
    (["compare", "--nnodes", "2"], "torchrun flag"),
    # option values and world-size requirements, checked by building the reducer once before the start
    (["compare", "--configs", "micro:0.01,lead=2"], "configuration 'micro': micro: lead must be a number in [0, 1]"),
    (["train", "--reducer", "micro", "--option", "spread=0.5"], "spread must be > 1"),
    (["train", "--reducer", "gtopk", "--workers", "3"], "power-of-two world size"),
]


def _one_line_error(capsys, argv):
    code = main(argv)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("note:")]
    return code, err


@pytest.mark.parametrize("argv,words", TRAIN_ERRORS, ids=[" ".join(a) for a, _ in TRAIN_ERRORS])
def test_train_compare_user_errors(tmp_path, capsys, argv, words):
    code, err = _one_line_error(capsys, [*argv, "--runs-dir", str(tmp_path / "runs"), "--no-progress"])
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert "Traceback" not in err[0]
    assert not (tmp_path / "runs").exists()  # nothing on disk


def test_network_checked_before_anything_exists(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for cmd in (["train"], ["compare", "--configs", "micro:0.01"]):
        code, err = _one_line_error(capsys, [*cmd, "--bandwidth", "1Gb/s", "--runs-dir", str(tmp_path / "r")])
        assert code == 2 and len(err) == 1 and "needs root" in err[0] and "--bandwidth 1gbit" in err[0]
    assert not (tmp_path / "r").exists()


OTHER_ERRORS = [
    (["simulate", "collectives", "--only", "bogus"], "--only: unknown bogus; valid:"),
    (["simulate", "schedule", "--algorithm", "bogus"], "invalid choice: 'bogus'"),
    (["simulate", "collectives", "--bandwidth", "1gbps"], "ambiguous"),
    (["simulate", "profile", "--model", "bogus"], "unknown model 'bogus'"),
    (["plan", "--model", "nope"], "unknown model 'nope'"),
    (["plan", "--reducers", "dense,nope"], "unknown reducer 'nope'"),
    (["plan", "--model", "no_such_module_xyz:make"], "cannot load it"),
    (["plan", "--bandwidth", "1gbps"], "ambiguous"),
    (["plan", "--a", "1e-3"], "both --a and --b"),
    (["bench", "allreduce", "--bandwidth", "1gbps"], "ambiguous"),
    (["bench", "reducers", "--workers", "0"], "positive integer"),
    (["bench-select", "--parts", "bogus"], "--parts: unknown bogus"),
    (["train-linear", "--algorithm", "nope", "--backend", "thread"], "unknown --algorithm 'nope'"),
    (["train-linear", "--batch-size", "0"], "positive integer"),
    (["cluster", "smoke", "--bandwidth", "1gbps"], "ambiguous"),
    (["run-default", "--steps", "0"], "positive integer"),
    (["nosuchcommand"], "invalid choice"),
]


@pytest.mark.parametrize("argv,words", OTHER_ERRORS, ids=[" ".join(a) for a, _ in OTHER_ERRORS])
def test_other_subcommands_user_errors(capsys, argv, words):
    code, err = _one_line_error(capsys, argv)
    assert code == 2 and len(err) == 1 and words in err[0], err


def test_deprecated_spellings_still_work(capsys):
    p = build_parser()
    assert p.parse_args(["bench", "reducers", "--world-sizes", "2,3"]).workers == [2, 3]
    assert "deprecated; use --workers" in capsys.readouterr().err
    a = p.parse_args(["simulate", "collectives", "--beta", "8e-9", "--alpha", "50us"])
    assert a.bandwidth == "1gbit" and a.latency == pytest.approx(5e-5)
    assert p.parse_args(["simulate", "collectives", "--beta", "1gbit"]).bandwidth == "1gbit"  # a rate works too
    assert p.parse_args(["simulate", "collectives", "--beta", "125MB/s"]).bandwidth == "1gbit"
    assert p.parse_args(["train-linear", "--batch", "7"]).batch_size == 7
    assert p.parse_args(["train", "--bandwidth", "1Gb/s"]).bandwidth == "1gbit"  # canonical tc spelling


# ------------------------------------------------------------------------------------- --help
def _all_parsers(parser, prefix=()):
    yield prefix, parser
    for a in parser._actions:
        if a.__class__.__name__ == "_SubParsersAction":
            for name, sub in a.choices.items():
                yield from _all_parsers(sub, (*prefix, name))


def test_every_help_shows_defaults_and_only_real_files():
    seen = 0
    for path, parser in _all_parsers(build_parser()):
        text = parser.format_help()
        fmt = parser._get_formatter()
        for a in parser._actions:
            d = a.default
            if a.option_strings and a.help != "==SUPPRESS==" and not (d is None or d is False or d == "==SUPPRESS=="):
                assert "default" in fmt._get_help_string(a), (path, a.dest)  # every default is shown
        for ref in re.findall(r"(?<![\w/])((?:docs|src|tests|spec|shared)/[\w./-]+|[\w-]+\.md)\b", text):
            ref = ref.rstrip(".")
            if ref == "report.md":  # what compare writes
                continue
            assert (ROOT / ref).exists() or (ROOT / "docs" / ref).exists(), (path, ref)
        assert "spec/" not in text and "DESIGN.md" not in text, path
        seen += 1
    assert seen >= 14


def test_every_option_has_help_and_no_sphinx_markup():
    import argparse

    for path, parser in _all_parsers(build_parser()):
        for a in parser._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
                assert a.help, (path, a.option_strings)
        text = parser.format_help()
        assert not re.search(r":[a-z]+:`|``", text), path  # :mod:`x` / ``x`` from docstrings
    assert "overrides --batch-size" in _help("train-linear")


def _help(name):
    return build_parser()._subparsers._group_actions[0].choices[name].format_help()
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--workers WORKERS" in text and "(default: 4)" in text and "(default: single)" in text


def test_help_and_version_do_not_import_torch():
    code = ("import sys, contextlib, io\nfrom sparsync.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['--version']) == 0 and main(['--help']) == 0 and main(['train', '--help']) == 0\n"
            "import sparsync\nprint('torch' in sys.modules, 'SparseDDP' in dir(sparsync))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


# ------------------------------------------------------------------------------------- library side
def test_make_reducer_unknown_option_names_valid_ones():
    import sparsync as ss
    from sparsync.threadcomm import ThreadComm  # noqa: F401 - the comm is never touched

    with pytest.raises(TypeError, match=r"unknown options: bogus; valid: .*teams"):
        ss.make_reducer("spardl", None, 0.01, bogus=1)
    with pytest.raises(TypeError, match=r"unknown options: teams; valid: nonfinite, value_dtype$"):  # the base's
        ss.make_reducer("topkdsa", None, 0.01, teams=2)


def test_missing_extra_is_one_clear_message():
    from sparsync.extras import MissingExtra, require

    with pytest.raises(MissingExtra, match=r"pip install 'sparsync\[train\]'"):
        require("no_such_package_xyz.sub", "train", "the digits workloads")
    assert require("json", "train", "x").dumps([1]) == "[1]"


# ------------------------------------------------------------------------------------- plan --model
USER_MODULE = '''
import torch

def make():
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 4))

def with_input():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(4)), \\
        torch.randn(2, 3, 10, 10)

def conv_only():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten())
'''


def test_plan_user_model_ranks_reducers(tmp_path, capsys, monkeypatch):
    import json

    (tmp_path / "usermod_plan.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    argv = ["plan", "--model", "usermod_plan:make", "--reducers", "dense,micro,spardl", "--workers", "4",
            "--bandwidth", "1Gb/s", "--steps", "1", "--batch-size", "8", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    n = 16 * 256 + 256 + 256 * 256 + 256 + 256 * 4 + 4
    assert d["numel"] == n and d["tensors"] == 6
    ranks = d["ranking"]
    assert sorted(r["reducer"] for r in ranks) == ["dense", "micro", "spardl"]
    assert [r["iteration_s"] for r in ranks] == sorted(r["iteration_s"] for r in ranks)
    dense = next(r for r in ranks if r["reducer"] == "dense")
    assert dense["bytes_received"] == pytest.approx(2 * 3 / 4 * n * 4)  # ring all-reduce, per rank
    assert dense["cost_model"]["b"] == pytest.approx(2 * 3 / 4 * 8 / 1e9, rel=1e-6)  # 1Gb/s = 1gbit
    assert all(r["cost_model"]["r2"] is not None and r["cost_model"]["r2"] > 0.9 for r in ranks)
    assert main(["plan", "--model", "usermod_plan:with_input", "--steps", "1"]) == 0  # (module, input) pair
    assert "groups of optimal" in capsys.readouterr().out
    assert main(["plan", "--model", "usermod_plan:conv_only", "--steps", "1"]) == 2
    assert "--input-shape" in capsys.readouterr().err
    assert main(["plan", "--model", "usermod_plan:conv_only", "--steps", "1", "--input-shape", "3,10,10"]) == 0


# ------------------------------------------------------------------------------------- compare outputs
def test_compare_writes_csv_json_and_load_runs(tmp_path, capsys):
    import csv
    import json

    import sparsync.train as st

    argv = ["compare", "--thread", "--no-baselines", "--configs", "topka:0.05;dense", "--workload", "digits-mlp",
            "--workload-option", "width=32", "--steps", "5", "--eval-every", "5", "--workers", "2",
            "--target-accuracy", "0.999", "--runs-dir", str(tmp_path), "--name", "cmp", "--no-progress"]
    assert main(argv) == 0
    root = tmp_path / "cmp"
    assert (root / "loss_vs_time.png").stat().st_size > 1000
    rows = list(csv.DictReader((root / "comparison.csv").open()))
    runs = st.load_runs(root)
    js = json.loads((root / "comparison.json").read_text())["runs"]
    assert [r["label"] for r in rows] == [r["label"] for r in js] == [r["label"] for r in runs] \
        == ["topka 0.05 (single)", "dense (single)"]  # configuration order, not alphabetical
    by = {r["reducer"]: r for r in runs}
    assert by["dense"]["speedup_step"] == 1.0 and by["dense"]["time_to_target_s"] is None  # 0.999 not reached
    assert by["topka"]["speedup_step"] == pytest.approx(by["dense"]["median_step_s"] / by["topka"]["median_step_s"])
    for r in rows:
        j = next(x for x in runs if x["label"] == r["label"])
        assert float(r["median_step_s"]) == pytest.approx(j["median_step_s"]) and r["time_to_target_s"] == ""
    md = (root / "report.md").read_text()
    assert "x step" in md and "loss_vs_time.png" in md  # step-time speed-up instead of "–"
    one = st.load_runs(root / "dense-single", with_metrics=True)
    assert len(one) == 1 and len(one[0]["metrics"]) == 5 and one[0]["path"].endswith("dense-single")
    with pytest.raises(FileNotFoundError):
        st.load_runs(tmp_path / "nothing")


# ------------------------------------------------------------------------------------- --tensorboard
def test_tensorboard_missing_package_is_a_usage_error(tmp_path, capsys):
    pytest.importorskip("torch")
    try:
        import tensorboard  # noqa: F401
        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    code, err = _one_line_error(capsys, ["train", "--thread", "--steps", "1", "--tensorboard", str(tmp_path / "tb"),
                                         "--runs-dir", str(tmp_path / "runs"), "--workload-option", "width=8"])
    assert code == 2 and len(err) == 1 and "pip install 'sparsync[tensorboard]'" in err[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tb").exists()


def test_metrics_tail_follows_appended_lines(tmp_path):
    """The tail writes each complete line once, in order, and waits for a line still being written."""
    import json

    from sparsync.train.tensorboard import MetricsTail

    written = []

    class Recorder:  # stands in for SummaryWriter (tensorboard is an optional extra)
        def __init__(self, logdir):
            self.logdir = logdir

        def add_scalar(self, tag, value, step):
            written.append((Path(self.logdir).name, tag, step, value))

        def flush(self):
            pass

        def close(self):
            pass

    run = tmp_path / "run"
    run.mkdir()
    tail = MetricsTail.__new__(MetricsTail)
    tail.SummaryWriter, tail.logdir, tail.runs, tail._offsets, tail._writers = Recorder, tmp_path / "tb", \
        [("micro 0.01 (single)", run)], {}, {}
    f = (run / "metrics.jsonl").open("w")
    f.write(json.dumps({"step": 0, "loss": 2.0, "time_s": 0.1, "step_s": 0.1, "comm_s": 0.02}) + "\n")
    f.write('{"step": 1, "loss": 1.')  # half a line
    f.flush()
    assert tail.poll() == 1
    f.write('5, "time_s": 0.2, "step_s": 0.1, "accuracy": 0.5}\n')
    f.flush()
    assert tail.poll() == 1 and tail.poll() == 0
    tags = [(t, s, v) for _, t, s, v in written]
    assert ("loss", 0, 2.0) in tags and ("loss", 1, 1.5) in tags and ("accuracy", 1, 0.5) in tags
    assert ("comm_ms", 0, pytest.approx(20.0)) in tags and ("loss_vs_time", 100, 2.0) in tags
    assert {d for d, *_ in written} == {"micro_0.01_single"}


def test_compare_all_failed_is_one_line(tmp_path, capsys, monkeypatch):
    """Every configuration failing at run time (each already reported) ends in one line, exit 1."""
    from sparsync.commands import compare as cmp

    def fail(args, **_):
        raise cmp.AllConfigurationsFailed("every configuration failed (1; the messages above say why)")

    monkeypatch.setattr(cmp, "compare", fail)
    code, err = _one_line_error(capsys, ["compare", "--thread", "--no-baselines", "--configs", "micro:0.01",
                                         "--runs-dir", str(tmp_path / "runs"), "--no-progress"])
    assert code == 1 and len(err) == 1 and "every configuration failed" in err[0] and "Traceback" not in err[0]


def test_labels_tell_configurations_apart():
    """Two compare rows that differ only in a reducer option get different labels (table, report)."""
    from sparsync.commands.compare import parse_configs
    from sparsync.train.runs import TrainConfig

    a, b = parse_configs("micro:0.02,momentum=0.9;micro:0.02,momentum=0.9,lead=0", 0.01, "single")
    la = TrainConfig(reducer="micro", density=0.02, reducer_options=a["options"], convergence=a["convergence"]).label()
    lb = TrainConfig(reducer="micro", density=0.02, reducer_options=b["options"], convergence=b["convergence"]).label()
    assert la != lb and "lead=0" in lb and "momentum=0.9" in la and "momentum=0.9" in lb


@pytest.mark.parametrize("workers", [2, 4])
def test_preflight_builds_every_reducer_with_its_defaults(workers):
    """The value check builds each registered reducer once (no collective, nothing gradient-sized):
    none of them is rejected with its defaults at a power-of-two world size."""
    from sparsync.commands.train import preflight
    from sparsync.reducers.registry import load_all
    from sparsync.train.runs import TrainConfig

    for name in sorted(load_all()):
        preflight(TrainConfig(reducer=name, density=0.01, workers=workers), network=False)
