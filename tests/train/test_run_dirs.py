"""Run directories that survive mistakes, concurrency, disks and restarts: a run name is one path
component; ``--force`` deletes only a directory sparsync made for a run; one writer per run
directory (a lock naming the holder's pid); checkpoints named by the step they hold; a torn metrics
line is dropped with a warning naming the file. Real runs (thread ranks where the case is about the
directory, real processes for the lock), real files."""

import json
import os
import signal
import warnings

import pytest
from faults_helpers import start_and_wait, tmpfs, train_cmd

from sparsync.cli import main
from sparsync.train.runs import (MARKER, MetricsWriter, RunBusy, RunDir, RunLock, check_run_name, is_run,
                                 read_metrics)

SMALL = ["--thread", "--workload", "digits-mlp", "--workload-option", "width=16", "--workers", "2",
         "--reducer", "micro", "--no-progress"]
COMPARE = ["compare", *SMALL[:-3], "--configs", "micro:0.05", "--no-baselines", "--no-progress", "--steps", "2"]


def _err(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def victim(tmp_path):
    """A directory beside the runs dir with a file in it, and the runs dir (holding one other run)."""
    v = tmp_path / "victim"
    v.mkdir()
    (v / "precious.txt").write_text("keep me")
    runs = tmp_path / "runs"
    assert main(["train", *SMALL, "--steps", "2", "--runs-dir", str(runs), "--name", "other"]) == 0
    return v, runs


BAD_NAMES = ["../victim", "", ".", "..", "/abs/path", "a/b"]


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("name", BAD_NAMES, ids=["dotdot", "empty", "dot", "dotdot-alone", "absolute", "nested"])
def test_run_names_are_one_path_component(victim, capsys, name, force):
    v, runs = victim
    before_v, before_runs = _tree(v), _tree(runs)
    argv = ["train", *SMALL, "--steps", "2", "--runs-dir", str(runs), "--name", name] + (["--force"] if force else [])
    assert main(argv) == 2
    assert "--name must be a single directory name inside the runs directory" in _err(capsys)
    assert _tree(v) == before_v and _tree(runs) == before_runs  # nothing deleted, nothing created
    assert main([*COMPARE, "--runs-dir", str(runs), "--name", name] + (["--force"] if force else [])) == 2
    assert "--name must be a single directory name" in _err(capsys)
    assert _tree(v) == before_v and _tree(runs) == before_runs


def test_compare_refuses_a_configuration_whose_directory_name_is_a_path(tmp_path, capsys):
    argv = [*COMPARE, "--configs", "micro:0.05,value_dtype=../../x", "--runs-dir", str(tmp_path), "--name", "c"]
    assert main(argv) == 2
    assert "its directory name must be a single directory name" in _err(capsys)
    assert list(tmp_path.iterdir()) == []


def test_force_deletes_only_a_sparsync_run(victim, capsys):
    v, runs = victim
    not_a_run = runs / "mine"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("mine")
    assert main(["train", *SMALL, "--steps", "2", "--runs-dir", str(runs), "--name", "mine", "--force"]) == 2
    assert "is not a sparsync run directory (no marker file); --force deletes only those" in _err(capsys)
    assert (not_a_run / "notes.txt").read_text() == "mine"
    # a config.json alone does not make a run (a marker, or an old run's config + metrics)
    (not_a_run / "config.json").write_text("{}")
    assert main(["train", *SMALL, "--steps", "2", "--runs-dir", str(runs), "--name", "mine", "--force"]) == 2
    capsys.readouterr()
    assert (not_a_run / "notes.txt").exists()
    # a real run is replaced, the lock file kept
    assert is_run(runs / "other") and json.loads((runs / "other" / MARKER).read_text())["kind"] == "train"
    (runs / "other" / "stale").write_text("x")
    assert main(["train", *SMALL, "--steps", "3", "--runs-dir", str(runs), "--name", "other", "--force"]) == 0
    assert not (runs / "other" / "stale").exists()
    assert [m["step"] for m in RunDir(runs / "other").metrics()] == [0, 1, 2]
    # compare: the same rule, with its own marker
    assert main([*COMPARE, "--runs-dir", str(runs), "--name", "mine", "--force"]) == 2
    assert "is not a sparsync comparison directory" in _err(capsys)
    assert main([*COMPARE, "--runs-dir", str(runs), "--name", "cmp"]) == 0
    assert is_run(runs / "cmp", "compare") and not is_run(runs / "cmp", "train")
    assert main([*COMPARE, "--runs-dir", str(runs), "--name", "cmp", "--force"]) == 0
    assert main([*COMPARE, "--runs-dir", str(runs), "--name", "other", "--force"]) == 2  # a run is not a comparison
    assert (v / "precious.txt").read_text() == "keep me"


def test_a_symlinked_run_directory_is_never_followed(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f").write_text("x")
    (runs / "link").symlink_to(tmp_path / "elsewhere")
    assert main(["train", *SMALL, "--steps", "2", "--runs-dir", str(runs), "--name", "link", "--force"]) == 2
    assert "is not a directory" in _err(capsys)
    assert (tmp_path / "elsewhere" / "f").exists()


def test_check_run_name():
    assert check_run_name("ok-name_1.x") == "ok-name_1.x"
    for bad in BAD_NAMES + [None, "a\0b"]:
        with pytest.raises(ValueError, match="single directory name"):
            check_run_name(bad)


# ---------------------------------------------------------------------- one writer per run
def test_lock_names_the_holder_and_is_freed_when_it_ends(tmp_path):
    (tmp_path / "r").mkdir()
    held = RunLock(tmp_path / "r").acquire()
    with pytest.raises(RunBusy, match=rf"is in use by another sparsync process \(pid {os.getpid()}\)"):
        RunLock(tmp_path / "r").acquire()
    held.release()
    RunLock(tmp_path / "r").acquire().release()


@pytest.mark.gloo
def test_force_and_resume_refuse_a_live_run(tmp_path, capsys):
    """A --force on a live run would delete its directory under it; a second --resume would write
    the same metrics and checkpoints twice: both get one line naming the live run's pid."""
    same = ("--checkpoint-every", "2", "--eval-every", "1000")
    assert main(train_cmd(tmp_path, "live", *same, steps=4, width=16)[3:]) == 0  # [3:]: after "python -m sparsync.cli"
    capsys.readouterr()
    live = start_and_wait(train_cmd(tmp_path, "live", "--resume", *same, width=16),
                          tmp_path / "live" / "metrics.jsonl", lines=8)
    try:
        for extra in (["--force"], ["--resume"]):
            assert main(train_cmd(tmp_path, "live", *extra, *same, width=16)[3:]) == 2
            assert _err(capsys) == (
                f"sparsync train: error: run directory {tmp_path / 'live'} is in use by another sparsync process "
                f"(pid {live.pid}); wait for it to end, or pick another --name")
        assert live.poll() is None  # the live run goes on
        n = len(RunDir(tmp_path / "live").metrics())
    finally:
        live.send_signal(signal.SIGTERM)
        live.communicate(timeout=60)
    steps = [m["step"] for m in RunDir(tmp_path / "live").metrics()]
    assert len(steps) >= n and steps == list(range(len(steps)))  # one writer: no duplicated step


# ---------------------------------------------------------------------- checkpoints named by their step
def test_resume_to_fewer_steps_than_the_checkpoint_is_refused(tmp_path, capsys):
    base = ["train", *SMALL, "--checkpoint-every", "4", "--runs-dir", str(tmp_path), "--name", "r"]
    assert main([*base, "--steps", "8"]) == 0
    rd = RunDir(tmp_path / "r")
    before = _tree(rd.path / "checkpoints")
    assert main([*base, "--steps", "4", "--resume"]) == 2
    assert _err(capsys) == (f"sparsync train: error: --resume --steps 4: the latest checkpoint of {rd.path} already "
                            "holds step 8; pass --steps 8 or more to continue it")
    assert _tree(rd.path / "checkpoints") == before
    assert main([*base, "--steps", "8", "--resume"]) == 0  # nothing left to do: nothing re-saved under another step
    capsys.readouterr()
    assert rd.latest_step() == 8 and rd.checkpoint_steps() == [4, 8]
    assert main([*base, "--steps", "12", "--resume"]) == 0
    assert rd.latest_step() == 12 and (rd.ckpt_dir(12) / "rank1.pt").exists()
    assert [m["step"] for m in rd.metrics()] == list(range(12))


def test_pruning_never_deletes_the_checkpoint_latest_names(tmp_path):
    rd = RunDir(tmp_path)
    for s in (4, 8, 12):
        rd.ckpt_dir(s).mkdir(parents=True)
    rd.mark_latest(4, keep=1)
    assert rd.latest_step() == 4 and rd.ckpt_dir(4).is_dir()


# ---------------------------------------------------------------------- metrics a torn write cannot break
def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_resume_works(tmp_path, capsys):
    base = ["train", *SMALL, "--checkpoint-every", "2", "--runs-dir", str(tmp_path), "--name", "t"]
    assert main([*base, "--steps", "4"]) == 0
    mf = tmp_path / "t" / "metrics.jsonl"
    with open(mf, "a") as f:
        f.write('{"step": 4, "loss": 0.12, "time_s": 1.')  # a write cut short (full disk, kill)
    with pytest.warns(RuntimeWarning, match=rf"{mf}: ignoring its torn last line"):
        assert [m["step"] for m in read_metrics(mf)] == [0, 1, 2, 3]
    from sparsync.train.records import load_runs

    with pytest.warns(RuntimeWarning, match="torn last line"):  # the report's reader too
        assert [m["step"] for m in load_runs(tmp_path / "t", with_metrics=True)[0]["metrics"]] == [0, 1, 2, 3]
    with pytest.warns(RuntimeWarning, match="torn last line"):
        assert main([*base, "--steps", "6", "--resume"]) == 0
    assert [m["step"] for m in read_metrics(mf)] == list(range(6))  # rewritten whole: no warning any more
    lines = mf.read_text().splitlines()
    lines.insert(2, "garbage")
    mf.write_text("\n".join(lines) + "\n")
    from sparsync.train.runs import CheckpointError

    with pytest.raises(CheckpointError, match=rf"{mf} line 3 is not a metrics record"):
        read_metrics(mf)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_while_appending_metrics_names_the_file(tmp_path):
    with tmpfs(tmp_path / "small") as d:
        w = MetricsWriter(d / "metrics.jsonl")
        with pytest.raises(OSError) as e:
            for i in range(100_000):
                w.write({"step": i, "loss": 1.0, "pad": "x" * 200})
        w.close()
        assert e.value.filename == str(d / "metrics.jsonl") and "No space left on device" in str(e.value)
        # whatever was written reads back: whole lines, at most a torn last one (dropped with a warning)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            steps = [m["step"] for m in read_metrics(d / "metrics.jsonl")]
        assert steps == list(range(len(steps))) and steps
