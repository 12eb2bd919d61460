"""Who owns a run directory: one path component inside ``runs_dir``, a marker file, an advisory lock.

A run name is one path component (:func:`check_run_name`: no ``/``, not ``.``, ``..`` or empty), so a
run never lands outside ``runs_dir``. A run directory carries a marker file (``.sparsync-run``) from
its creation on, and ``--force`` empties only a directory that has it (:func:`is_run`): never a
directory sparsync did not make. Every writer holds an advisory lock (``fcntl.flock`` on
``<run>/.lock``, :class:`RunLock`) from preparing the directory to the end of the run; a second writer
(a second ``--resume``, a ``--force`` on a live run) gets :class:`~sparsync.train.errors.RunBusy`
naming the holder's pid. ``--force`` empties the directory but keeps the lock file, so the lock stays
one file for the directory's whole life. Small files are replaced whole (:func:`atomic_write`).

Failed writes (a full disk): every error names the file it could not write (:func:`atomic_write`,
:func:`named_errors`), no lock is left held, and a directory whose start failed - one this process
created or ``--force`` emptied, holding only what the start wrote - is removed, lock file included
(:meth:`RunLock.abandon`). A set of files that belong together (a comparison's report, plots and
data) is written into a temporary directory and moved into place only once all of it is written
(:func:`staged_files`): a failure leaves the previous set, or none, never a part of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .errors import RunBusy, RunExists

__all__ = ["LOCK", "MARKER", "RUN_FORMAT", "RunLock", "atomic_write", "check_run_name", "is_run", "named_errors",
           "prepare_dir", "run_job", "staged_files"]

RUN_FORMAT = "sparsync-run/1"
MARKER = ".sparsync-run"   # written when a run (or a comparison) directory is created
LOCK = ".lock"             # the advisory lock file of a run directory (kept by --force)


def check_run_name(name, what: str = "--name") -> str:
    """``name`` if it is one path component (a directory name inside ``runs_dir``), else ValueError."""
    bad = (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name
           or bool(os.altsep and os.altsep in name))
    if bad:
        raise ValueError(f"{what} must be a single directory name inside the runs directory (no '/', not '.', "
                         f"'..' or empty), got {name!r}")
    return name


def _marker(path: Path) -> dict | None:
    try:
        d = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("format") == RUN_FORMAT else None


def is_run(path, kind: str = "train") -> bool:
    """Whether ``path`` is a directory sparsync made for a run (``kind="train"``) or a comparison
    (``"compare"``): its marker file says so. Directories of older versions (no marker) count when
    they hold what only sparsync writes: a train run's ``config.json`` with its fingerprint and
    ``metrics.jsonl``, a comparison's ``comparison.json``. A symbolic link never counts."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    m = _marker(path)
    if m is not None:
        return m.get("kind") == kind
    if kind == "compare":
        return (path / "comparison.json").is_file()
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "fingerprint" in cfg and (path / "metrics.jsonl").is_file()


def _clear(path: Path, keep: tuple[str, ...] = (LOCK,)) -> None:
    """Remove everything inside ``path`` except the names in ``keep`` (links are removed, not followed)."""
    for x in path.iterdir():
        if x.name in keep:
            continue
        if x.is_dir() and not x.is_symlink():
            shutil.rmtree(x)
        else:
            x.unlink()


class RunLock:
    """An exclusive advisory lock on a run directory: ``fcntl.flock`` on ``<dir>/.lock``, which holds
    the owner's pid. The kernel drops it when the owner's last descriptor closes (a killed launcher
    frees it at once). :meth:`acquire` raises :class:`RunBusy` naming the holder."""

    def __init__(self, path, what: str = "run directory"):
        self.path, self.what, self.fd = Path(path), what, None
        self.fresh = False  # prepare_dir: the directory was created, or emptied by --force, under this lock

    def acquire(self) -> RunLock:
        """Take the lock and write this process's pid into the lock file. :class:`RunBusy` when another
        process holds it. When the lock file cannot be created or written (a full disk) the
        ``OSError`` names it and nothing stays held: the start is abandoned (:meth:`abandon` - a
        :attr:`fresh` directory holding nothing else goes, lock file included)."""
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunBusy(f"{self.what} {self.path} is in use by another sparsync process (pid {holder}); "
                          "wait for it to end, or pick another --name") from None
        self.fd = fd
        try:
            with named_errors(self.path / LOCK):  # a write on a full disk names no file by itself
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            self.abandon()
            raise
        return self

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    close = release  # contextlib.closing

    def abandon(self, written=()) -> None:
        """A start that failed under this lock: when the directory is :attr:`fresh` and holds nothing but
        the marker, the lock file and the names in ``written`` (or their temp files), remove them and
        the directory; then release. Anything else in it (another writer's file) keeps it there."""
        try:
            if self.fresh and self.fd is not None:
                ours = {MARKER, LOCK, *written}
                names = [x.name for x in self.path.iterdir()]
                if all(n in ours or n.split(".tmp")[0] in ours for n in names):
                    for n in names:
                        if n != LOCK:
                            (self.path / n).unlink(missing_ok=True)
                    (self.path / LOCK).unlink(missing_ok=True)  # last: while it exists, the lock is ours
                    self.path.rmdir()
        except OSError:
            pass  # best effort: the error that ended the start is the one to report
        finally:
            self.release()


def prepare_dir(path, kind: str, force: bool, job: str | None = None, what: str = "run directory") -> RunLock:
    """Create (or, with ``force``, empty) the run or comparison directory ``path`` and lock it; returns
    the held :class:`RunLock`. An existing non-empty directory is refused without ``force``, and
    with it unless it :func:`is_run` of ``kind`` (nothing else is ever deleted); a locked one is
    refused (:class:`RunBusy`). Writes the marker (``job``: the torchrun job that made it)."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise RunExists(f"{path} exists and is not a directory; pick another --name or --runs-dir")

    def refuse_unless_ours():
        if path.is_dir() and any(x.name != LOCK for x in path.iterdir()):
            if not force:
                raise RunExists(f"{what} {path} already exists; pass --force to overwrite it, "
                                + ("--resume to continue it, " if kind == "train" else "")
                                + "or --name to pick another name")
            if not is_run(path, kind):
                raise RunExists(f"{path} exists and is not a sparsync {'run' if kind == 'train' else 'comparison'} "
                                "directory (no marker file); --force deletes only those - pick another --name")
            return True
        return False

    refuse_unless_ours()  # before anything is created in a directory that is not ours
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    lock = RunLock(path, what)
    lock.fresh = created  # a lock that cannot be taken (a full disk) leaves no directory made here
    try:
        lock.acquire()
    except OSError:  # not RunBusy: the lock file could not be created or written
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()  # only if empty: acquire removed what it wrote
        raise
    try:
        lock.fresh = created or [x.name for x in path.iterdir()] == [LOCK]  # ours alone: made by sparsync
        if refuse_unless_ours():  # again under the lock: another process may have written meanwhile
            _clear(path)
            lock.fresh = True
        atomic_write(path / MARKER, json.dumps({"format": RUN_FORMAT, "kind": kind, "job": job}))
    except BaseException:
        lock.abandon()  # a failed start leaves no directory (and no lock file) behind it
        raise
    return lock


def run_job(path) -> str | None:
    """The torchrun job recorded in a run directory's marker (None: none, or no marker)."""
    m = _marker(Path(path))
    return m.get("job") if m else None


@contextlib.contextmanager
def named_errors(path) -> Iterator[None]:
    """An ``OSError`` raised inside that names no file (a write on a full disk) is raised again naming
    ``path``, the file being written; one that names its file passes unchanged."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


@contextlib.contextmanager
def staged_files(out_dir, tag: str = "staged") -> Iterator[Path]:
    """A temporary directory inside ``out_dir`` for a set of files written together; when the block
    ends without an error, each file is moved (a rename) to ``out_dir`` under its own name, replacing
    the previous one. On an error the temporary directory is removed - ``out_dir`` keeps the previous
    set, or none - and an ``OSError`` naming a staged file is raised again naming the file it was to
    become in ``out_dir``. Leftovers of a killed writer (``.<tag>.tmp<pid>``) are removed first; the
    caller holds ``out_dir``'s lock."""
    out_dir = Path(out_dir)
    for old in out_dir.glob(f".{tag}.tmp*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = out_dir / f".{tag}.tmp{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        for f in sorted(tmp.iterdir()):
            os.replace(f, out_dir / f.name)
        tmp.rmdir()
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno is None:
            raise
        name = e.filename
        if isinstance(name, (str, os.PathLike)) and Path(name).parent == tmp:
            name = out_dir / Path(name).name  # the file it was to become
        raise OSError(e.errno, e.strerror, str(name) if name is not None else None) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename: readers see the old file or the new one,
    never a part; a failed write removes the temp file and raises ``OSError`` naming ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:  # a write error names no file by itself (a full disk: which one?)
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
