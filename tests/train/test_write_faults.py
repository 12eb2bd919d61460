"""Writers of run and comparison directories under faults: ``compare`` and ``train`` hold the
directory's lock until their report and summary are written; a failed write (a full disk, simulated
with ``OSError(ENOSPC)`` from the writer) names the file, leaves no lock, and a comparison's report,
plots and data appear as a whole set or not at all. Thread ranks, real CLI, real files."""

import errno
import pathlib

import pytest

from sparsync.cli import main
from sparsync.train.runs import RunBusy, RunDir, RunLock

SMALL = ["--thread", "--workload", "digits-mlp", "--workload-option", "width=16", "--workers", "2", "--no-progress",
         "--steps", "2"]
REPORT_SET = {"report.md", "comparison.csv", "comparison.json", "accuracy_vs_time.png", "loss_vs_time.png",
              "time_to_target.png", "step_breakdown.png", "bytes_per_step.png", "density.png"}


def _err(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines, "nothing on stderr"
    return lines[-1]


def _compare(runs, *extra):
    return ["compare", *SMALL, "--configs", "micro:0.05", "--no-baselines", "--runs-dir", str(runs), "--name", "c",
            *extra]


def _full_disk(monkeypatch, cls, method, hit):
    """Make ``cls.method`` raise ENOSPC (naming no file, as a write on a full disk does) when
    ``hit(self, path)`` says so, after writing a few bytes there (a torn file)."""
    real = getattr(cls, method)

    def writer(self, *a, **k):
        path = self if cls is pathlib.Path else pathlib.Path(a[0])
        if hit(path):
            with open(path, "wb") as f:
                f.write(b"torn")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(cls, method, writer)


# ------------------------------------------------------------------------------ the lock
def test_compare_writes_report_and_data_under_the_comparison_lock(tmp_path, capsys, monkeypatch):
    """A --force racing the report (the directory cleared under it: a missing summary.json) is refused."""
    import sparsync.train.records as records
    import sparsync.train.report as report

    runs, seen = tmp_path / "runs", []

    def probe(fn, race=False):
        def wrapped(*a, **k):
            try:
                RunLock(runs / "c").acquire().release()
                seen.append((fn.__name__, "free"))
            except RunBusy:
                seen.append((fn.__name__, "held"))
            if race:  # the racing invocation, in the middle of the report
                assert main(_compare(runs, "--force")) == 2
                assert "is in use by another sparsync process" in _err(capsys)
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(report, "write_report", probe(report.write_report, race=True))
    monkeypatch.setattr(records, "write_comparison", probe(records.write_comparison))
    assert main(_compare(runs)) == 0
    assert seen == [("write_report", "held"), ("write_comparison", "held")]
    assert REPORT_SET <= {p.name for p in (runs / "c").iterdir()}
    assert RunDir(runs / "c" / "micro-0.05-single").summary()["config"] == "micro-0.05-single"


def test_train_writes_its_summary_under_the_run_lock(tmp_path, monkeypatch):
    seen, real = [], RunDir.write_summary

    def probe(self, summary):
        try:
            RunLock(self.path).acquire().release()
            seen.append("free")
        except RunBusy:
            seen.append("held")
        return real(self, summary)

    monkeypatch.setattr(RunDir, "write_summary", probe)
    assert main(["train", *SMALL, "--runs-dir", str(tmp_path), "--name", "t"]) == 0
    assert seen == ["held"] and RunDir(tmp_path / "t").summary() is not None


def test_compare_writes_each_runs_summary_once_with_its_row_under_the_run_lock(tmp_path, monkeypatch):
    """No moment where summary.json lacks the row's fields, or where the run's lock is free before it is written."""
    seen, real = [], RunDir.write_summary

    def probe(self, summary):
        try:
            RunLock(self.path).acquire().release()
            held = "free"
        except RunBusy:
            held = "held"
        seen.append((self.path.name, summary.get("config"), held))
        return real(self, summary)

    monkeypatch.setattr(RunDir, "write_summary", probe)
    assert main(_compare(tmp_path)) == 0
    assert seen == [("micro-0.05-single", "micro-0.05-single", "held")]


# ------------------------------------------------------------------------------ a full disk
@pytest.mark.parametrize("name", [".sparsync-run", "config.json", "metrics.jsonl"])
def test_a_full_disk_at_the_start_names_the_file_and_leaves_no_directory(tmp_path, capsys, monkeypatch, name):
    _full_disk(monkeypatch, pathlib.Path, "write_text", lambda p: p.name.startswith(name))
    runs = tmp_path / "runs"
    assert main(["train", *SMALL, "--runs-dir", str(runs), "--name", "r"]) == 2
    assert _err(capsys) == f"sparsync train: error: No space left on device: {runs / 'r' / name}"
    assert not (runs / "r").exists()  # no directory, no .lock: the next start is not refused
    monkeypatch.undo()
    assert main(["train", *SMALL, "--runs-dir", str(runs), "--name", "r"]) == 0


def test_a_full_disk_at_the_start_of_a_forced_run_leaves_no_lock(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    assert main(["train", *SMALL, "--runs-dir", str(runs), "--name", "r"]) == 0
    _full_disk(monkeypatch, pathlib.Path, "write_text", lambda p: p.name.startswith("config.json"))
    assert main(["train", *SMALL, "--runs-dir", str(runs), "--name", "r", "--force"]) == 2
    assert _err(capsys).endswith(f"No space left on device: {runs / 'r' / 'config.json'}")
    assert not (runs / "r").exists()


def test_a_full_disk_during_the_report_leaves_no_partial_set(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    runs = tmp_path / "runs"
    root = runs / "c"
    _full_disk(monkeypatch, Figure, "savefig", lambda p: p.name == "time_to_target.png")  # the third plot
    assert main(_compare(runs)) == 2
    assert _err(capsys) == f"sparsync compare: error: No space left on device: {root / 'time_to_target.png'}"
    assert {p.name for p in root.iterdir()} == {".lock", ".sparsync-run", "micro-0.05-single"}  # runs kept, no plot
    RunLock(root).acquire().release()  # not held
    monkeypatch.undo()
    assert main(_compare(runs, "--resume")) == 0  # the run is kept, the report written whole
    before = {p.name: p.read_bytes() for p in root.iterdir() if p.name in REPORT_SET}
    assert set(before) == REPORT_SET
    # a later report that fails on its text keeps the previous set as it was
    _full_disk(monkeypatch, pathlib.Path, "write_text", lambda p: p.name == "report.md")
    assert main(_compare(runs, "--resume")) == 2
    assert _err(capsys) == f"sparsync compare: error: No space left on device: {root / 'report.md'}"
    assert {p.name: p.read_bytes() for p in root.iterdir() if p.name in REPORT_SET} == before
    assert not [p for p in root.iterdir() if ".tmp" in p.name]
