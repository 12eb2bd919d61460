"""Every rate and site layout of a run is read and bounded before anything is created: a refusal is
one line (exit 2) and leaves no run directory and no network namespace. Thread ranks, real CLI."""

import pytest

from sparsync.cli import main
from sparsync.cluster import Links, link_bandwidth, parse_rate_schedule
from sparsync.commands import UsageError, parse_kv
from sparsync.commands.compare import parse_configs

SMALL = ["--workload", "digits-mlp", "--workload-option", "width=16", "--no-progress", "--steps", "2"]


def _err(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _nothing_in(path) -> bool:
    return not path.exists() or list(path.iterdir()) == []


# ------------------------------------------------------------------------------ rates: one bound
@pytest.mark.parametrize("rate", ["1e30gbit", "2000gbit"])
def test_a_scheduled_rate_is_bounded_as_bandwidth_is(rate):
    with pytest.raises(ValueError) as bw:
        link_bandwidth(rate)
    with pytest.raises(ValueError) as sched:
        parse_rate_schedule(f"2:100mbit,4:{rate}")
    assert str(sched.value) == f"--rate-schedule '4:{rate}': {bw.value}"  # the same rule, naming the item
    with pytest.raises(ValueError, match="at most 1000gbit"):
        Links("sparsync-none", 2).set_rate("inter", rate)  # refused before any tc runs
    assert parse_rate_schedule("2:100mbit,4:none") == {2: 100_000_000, 4: None}


def test_an_unbounded_rate_schedule_is_refused_before_any_namespace(tmp_path, capsys):
    runs = tmp_path / "runs"
    argv = ["train", *SMALL, "--steps", "4", "--workers", "2", "--bandwidth", "1gbit", "--rate-schedule", "2:1e30gbit",
            "--runs-dir", str(runs)]
    assert main(argv) == 2
    err = _err(capsys)
    assert "--rate-schedule '2:1e30gbit': bandwidth must be at most 1000gbit" in err and "sch_tbf" not in err
    assert _nothing_in(runs)
    assert main(["compare", *argv[1:], "--configs", "dense", "--no-baselines"]) == 2
    assert "--rate-schedule '2:1e30gbit'" in _err(capsys) and _nothing_in(runs)


@pytest.mark.parametrize("argv", [["bench", "allreduce", "--bandwidth", "loopback,1e30gbit"],
                                  ["bench", "reducers", "--bandwidth", "1gbit,2000gbit"],
                                  ["cluster", "smoke", "--bandwidth", "1e30gbit"],
                                  ["plan", "--measure", "2000gbit"],
                                  ["train-linear", "--bandwidth", "1bit"]])
def test_every_emulated_network_is_bounded_while_the_options_are_read(argv, capsys, monkeypatch):
    """A list of networks is refused whole, before its first network runs."""
    import sparsync.bench.allreduce
    import sparsync.bench.reducers
    import sparsync.cluster

    def runs(*a, **k):
        raise AssertionError("a network ran before the bad rate was refused")

    for mod, fn in ((sparsync.bench.allreduce, "run_allreduce_bench"), (sparsync.bench.reducers, "run_reducer_bench"),
                    (sparsync.cluster, "open_network"), (sparsync.cluster, "run_emulated")):
        monkeypatch.setattr(mod, fn, runs)
    assert main(argv) == 2
    err = _err(capsys)
    assert err.startswith(f"sparsync {' '.join(argv[:-2])}: error: argument {argv[-2]}: bandwidth must be at "), err


# ------------------------------------------------------------------------------ site layouts
def test_a_site_layout_from_the_environment_is_checked_against_the_world(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPARSYNC_SITES", "0,1;2")
    runs = tmp_path / "runs"
    assert main(["train", *SMALL, "--thread", "--workers", "4", "--reducer", "hier", "--runs-dir", str(runs)]) == 2
    assert _err(capsys) == ("sparsync train: error: SPARSYNC_SITES='0,1;2': sites 0,1;2 must hold every rank 0..3 "
                            "exactly once (world size 4)")
    assert _nothing_in(runs)
    assert main(["compare", *SMALL, "--thread", "--workers", "4", "--configs", "hier:0.05", "--no-baselines",
                 "--runs-dir", str(runs)]) == 2
    assert "configuration 'hier': SPARSYNC_SITES='0,1;2': sites 0,1;2 must hold every rank" in _err(capsys)
    assert _nothing_in(runs)
    # it reaches every rank of every reducer: refused for dense too, never read wrong by nobody
    monkeypatch.setenv("SPARSYNC_SITES", "0,1;2,3")
    assert main(["train", *SMALL, "--thread", "--workers", "2", "--reducer", "dense", "--runs-dir", str(runs)]) == 2
    assert "SPARSYNC_SITES='0,1;2,3': sites 0,1;2,3 must hold every rank 0..1 exactly once" in _err(capsys)


@pytest.mark.parametrize("argv", [["bench", "reducers", "--reducers", "hier", "--workers", "4,2"],
                                  ["bench", "allreduce", "--workers", "4"],
                                  ["plan", "--reducers", "hier", "--workers", "4", "--measure", "loopback"]])
def test_a_site_layout_from_the_environment_is_checked_before_any_bench_runs(argv, capsys, monkeypatch):
    """Benchmarks start ranks that read it too (hier, auto): refused before the first run, naming it."""
    import sparsync.bench.allreduce
    import sparsync.bench.reducers
    import sparsync.commands.plan

    def runs(*a, **k):
        raise AssertionError("ranks started before the site layout was checked")

    for mod, fn in ((sparsync.bench.allreduce, "run_allreduce_bench"), (sparsync.bench.reducers, "run_reducer_bench"),
                    (sparsync.commands.plan, "load_model")):
        monkeypatch.setattr(mod, fn, runs)
    monkeypatch.setenv("SPARSYNC_SITES", "0,1;2")
    assert main(argv) == 2
    assert _err(capsys) == (f"sparsync {argv[0]}: error: SPARSYNC_SITES='0,1;2': sites 0,1;2 must hold every rank "
                            "0..3 exactly once (world size 4)")
    from sparsync.commands._preflight import check_site_env

    monkeypatch.setenv("SPARSYNC_SITES", "0,1;2,3")
    check_site_env([4], ["loopback", "1gbit"])
    check_site_env([2], ["2x1@1gbit/100mbit"])  # a topology gives its ranks its own layout


def test_a_comma_site_layout_passes_through_option_sites_quoted(tmp_path, capsys):
    assert parse_kv(['sites="0,2;1,3",outer=micro'], "--option") == {"sites": "0,2;1,3", "outer": "micro"}
    assert parse_kv(["x='1'"], "--option") == {"x": "1"}  # quoted: the string as written
    with pytest.raises(UsageError, match="the quote \" is never closed"):
        parse_kv(['sites="0,2;1,3'], "--option")
    # unquoted, the layout splits the list: the one-line error says how to write it
    hint = "a value holding ',' or ';' is quoted, e.g. sites=\"0,2;1,3\""
    with pytest.raises(UsageError) as e:
        parse_kv(["sites=0,1;2,3"], "--option")
    assert str(e.value) == f"--option must look like key=value, got '1;2' ({hint})"
    with pytest.raises(UsageError) as e:
        parse_configs("hier:0.02,sites=0,2;1,3", 0.01, "single")
    assert str(e.value) == f"config 'hier:0.02,sites=0,2': '2' should be key=value ({hint})"
    rows = parse_configs('hier:0.02,sites="0,2;1,3";dense', 0.01, "single")
    assert [(r["reducer"], r["options"]) for r in rows] == [("hier", {"sites": "0,2;1,3"}), ("dense", {})]
    runs = tmp_path / "runs"
    base = ["train", *SMALL, "--thread", "--workers", "4", "--reducer", "hier", "--runs-dir", str(runs), "--name", "h"]
    assert main([*base, "--option", 'sites="0,2;1"']) == 2
    assert _err(capsys) == ("sparsync train: error: --option sites='0,2;1': sites 0,2;1 must hold every rank 0..3 "
                            "exactly once (world size 4)")
    assert _nothing_in(runs)
    assert main([*base, "--option", 'sites="0,2;1,3"']) == 0
    assert "sites=0,2;1,3" in capsys.readouterr().out
    import json

    assert json.loads((runs / "h" / "config.json").read_text())["reducer_options"] == {"sites": "0,2;1,3"}


# ------------------------------------------------------------------------------ unknown reducer
def test_an_unknown_reducer_is_one_line_with_or_without_local_steps(tmp_path, capsys):
    runs = tmp_path / "runs"
    errs = []
    for configs in ("nosuch:0.02", "nosuch:0.02,sync_every=4"):
        assert main(["compare", *SMALL, "--thread", "--workers", "2", "--configs", configs, "--no-baselines",
                     "--runs-dir", str(runs)]) == 2
        errs.append(_err(capsys))
    assert errs[0] == errs[1] and errs[0].startswith("sparsync compare: error: configuration 'nosuch': unknown "
                                                     "reducer 'nosuch'; valid: ")
    assert main(["train", *SMALL, "--thread", "--workers", "2", "--reducer", "nosuch", "--sync-every", "4",
                 "--runs-dir", str(runs)]) == 2
    assert "error: unknown reducer 'nosuch'; valid: " in _err(capsys)
    assert _nothing_in(runs)
