"""A disk that is already full when a run starts: the first write of a run is the pid in its lock file
(``<run>/.lock``), and a write on a full disk names no file by itself. The error names the lock file,
no directory and no lock is left, and the next start is not refused. Simulated (``os.pwrite`` raising
ENOSPC) and, as root, on a real full tmpfs. Real CLI, thread ranks."""

import contextlib
import errno
import os
import subprocess

import pytest

from sparsync.cli import main
from sparsync.train.ownership import LOCK, RunLock, prepare_dir

SMALL = ["--thread", "--workload", "digits-mlp", "--workload-option", "width=16", "--workers", "2", "--no-progress",
         "--steps", "2"]


def _err(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines, "nothing on stderr"
    return lines[-1]


def _full_lock_files(monkeypatch):
    """``os.pwrite`` raises ENOSPC (naming no file, as on a full disk) for every lock file."""
    real = os.pwrite

    def pwrite(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/" + LOCK):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)


def test_a_full_disk_at_the_lock_file_names_it_and_leaves_no_directory(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    _full_lock_files(monkeypatch)
    assert main(["train", *SMALL, "--runs-dir", str(runs), "--name", "r"]) == 2
    assert _err(capsys) == f"sparsync train: error: No space left on device: {runs / 'r' / LOCK}"
    assert list(runs.iterdir()) == []  # no run directory, no .lock
    assert main(["compare", *SMALL, "--configs", "micro:0.05", "--no-baselines", "--runs-dir", str(runs),
                 "--name", "c"]) == 2
    assert _err(capsys) == f"sparsync compare: error: No space left on device: {runs / 'c' / LOCK}"
    assert list(runs.iterdir()) == []
    monkeypatch.undo()
    assert main(["train", *SMALL, "--runs-dir", str(runs), "--name", "r"]) == 0


def test_a_lock_that_cannot_be_written_is_not_held(tmp_path, monkeypatch):
    """An existing directory (a resume, a --force) keeps its files; the lock is free afterwards."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "keep").write_text("x")
    _full_lock_files(monkeypatch)
    with pytest.raises(OSError) as e:
        RunLock(d).acquire()
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(d / LOCK))
    with pytest.raises(OSError):
        prepare_dir(tmp_path / "new", "train", force=False)
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    RunLock(d).acquire().release()  # not held by the failed attempt
    assert (d / "keep").read_text() == "x"


def test_a_comparison_whose_every_run_hit_a_full_disk_leaves_no_directory(tmp_path, capsys, monkeypatch):
    import pathlib

    real = pathlib.Path.write_text

    def write_text(self, *a, **k):
        if self.name.startswith("config.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    runs = tmp_path / "runs"
    argv = ["compare", *SMALL, "--configs", "micro:0.05;topka:0.05", "--no-baselines", "--runs-dir", str(runs),
            "--name", "c"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"No space left on device: '{runs / 'c' / 'micro-0.05-single' / 'config.json'}'" in err
    assert "every configuration failed (2" in err
    assert list(runs.iterdir()) == []  # no comparison directory, no .lock: the same command runs again
    monkeypatch.undo()
    assert main(argv) == 0


@contextlib.contextmanager
def _full_tmpfs(path):
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(path / "fill", "wb", buffering=0) as f:  # fill it: every later write gets ENOSPC
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 1024)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_run_on_a_really_full_disk_names_the_file_and_leaves_no_lock(tmp_path, capsys):
    with _full_tmpfs(tmp_path / "full") as disk:
        runs = disk / "runs"
        assert main(["train", *SMALL, "--runs-dir", str(runs), "--name", "r"]) == 2
        err = _err(capsys)
        assert err.startswith("sparsync train: error: No space left on device: ") and str(runs / "r") in err
        assert not (runs / "r").exists()
