"""Writers of run and comparison directories under faults: ``compare`` and ``train`` hold the
directory's lock until their report and summary are written; a failed write (a full disk, simulated
with ``OSError(ENOSPC)`` from the writer) names the file, leaves no lock, and a comparison's report,
plots and data appear as a whole set or not at all. Thread ranks, real CLI, real files."""

import contextlib
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


def test_run_default_writes_its_verdict_into_the_report_under_the_comparison_lock(tmp_path, capsys, monkeypatch):
    """The verdict is part of the report set: written before the lock is released, or the report is not moved in."""
    import sparsync.commands.run_default as rd

    root, seen, real = tmp_path / "make-run", [], rd.verdict

    def probe(runs):
        try:
            RunLock(root).acquire().release()
            seen.append("free")
        except RunBusy:
            seen.append("held")
        return real(runs)

    monkeypatch.setattr(rd, "verdict", probe)
    argv = ["run-default", "--loopback", "--workers", "2", "--steps", "2", "--seeds", "1", "--sparse", "micro:0.05",
            "--no-progress", "--runs-dir", str(tmp_path)]
    assert main(argv) == 0
    assert seen == ["held"]
    report = (root / "report.md").read_text()
    assert report.count("## Verdict") == 1 and real(rd.json.loads((root / "comparison.json").read_text())["runs"]) \
        .splitlines()[0] in report
    # a report that cannot be written leaves the previous set, verdict included, as it was
    before = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}

    def full(runs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rd, "verdict", full)
    assert main([*argv, "--resume"]) == 2  # every run kept, the report set written again: the verdict fails
    assert {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()} == before
    assert not [p for p in root.iterdir() if ".tmp" in p.name]


def test_run_default_gpt_holds_its_directory_until_its_report_is_written(tmp_path, capsys, monkeypatch):
    """Its two passes are comparisons of their own; the merged report beside them is written under a lock
    on ``make-run-gpt`` held from the first pass on (the passes are stand-ins here)."""
    import sparsync.commands._run_default_gpt as gpt
    import sparsync.commands.compare as compare

    root, seen = tmp_path / "make-run-gpt", []

    def held(what):
        try:
            RunLock(root).acquire().release()
            seen.append((what, "free"))
        except RunBusy:
            seen.append((what, "held"))

    def a_pass(args, **k):
        (root / args.name).mkdir(parents=True, exist_ok=True)
        held(args.name)

    monkeypatch.setattr(compare, "compare", a_pass)
    monkeypatch.setattr(gpt, "_runs", lambda d: [])
    monkeypatch.setattr(gpt, "merged", lambda a, b: [])
    monkeypatch.setattr(gpt, "format_merged", lambda rows, net: "the table")
    monkeypatch.setattr(gpt, "verdict", lambda rows, timed: held("verdict") or "the verdict")
    argv = ["run-default", "--workload", "gpt", "--loopback", "--no-progress", "--runs-dir", str(tmp_path)]
    assert main(argv) == 0
    assert seen == [("convergence", "held"), ("time", "held"), ("verdict", "held")]
    assert "the table\n\nthe verdict" in (root / "report.md").read_text()
    with contextlib.closing(RunLock(root).acquire()):  # a second one meanwhile: refused before its first pass
        assert main(argv) == 2
    assert "is in use by another sparsync process" in _err(capsys) and len(seen) == 3


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
