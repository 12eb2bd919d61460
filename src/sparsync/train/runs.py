"""Run directories: ``runs/<name>/`` with config.json, metrics.jsonl, summary.json and checkpoints.

Layout::

    runs/<name>/config.json        the full TrainConfig (what was asked for, after defaults)
    runs/<name>/metrics.jsonl      one JSON object per step (rank 0's view), eval points included
    runs/<name>/summary.json       final accuracy, time to target, mean time split, bytes
    runs/<name>/checkpoints/step_000040/rank0.pt ... rankP-1.pt   one file per rank
    runs/<name>/checkpoints/latest  text file naming the newest complete checkpoint

Safety and disk (docs/reliability.md): checkpoint files are read with ``torch.load(...,
weights_only=True)`` - tensors and plain containers only, so a crafted file cannot run code - and
their format is checked before anything in them is used. Only the newest ``keep_checkpoints``
complete checkpoints are kept (``--keep-checkpoints``, default 2; 0 keeps all). Temp files of
killed saves (``*.tmp<pid>``) and checkpoint directories newer than ``latest`` (a save that never
completed) are removed when a run starts, resumes or fails. A failed save (a full disk) raises a
:class:`CheckpointError` naming the file and the error; ``latest`` still names the previous
complete checkpoint, which ``--resume`` then uses.

Why per-rank checkpoint files: the reducers' error-feedback residuals differ per rank, so a
bitwise-identical resume needs every rank's state. A checkpoint counts as complete only once
``latest`` names it (written by rank 0 after every rank has saved), so a crash in the middle of
saving leaves the previous checkpoint in charge.

Refusals (clear messages, never a silent overwrite): an existing run directory without ``--force``
or ``--resume``; ``--resume`` with no checkpoint; a checkpoint whose file is unreadable (corrupt) or
whose config fingerprint / world size / rank differs from the run's; ``--resume --steps N`` with N
below the step the latest checkpoint holds (checkpoints are named by the step whose state they hold).

The parts: :mod:`.config` (:class:`TrainConfig`, its fingerprint), :mod:`.ownership` (run names,
the marker file that ``--force`` requires, the advisory lock every writer holds: :class:`RunLock`,
:func:`prepare_dir`), :mod:`.metrics_file` (the append-only ``metrics.jsonl``), :mod:`.errors` (the
refusals); this module holds :class:`RunDir` and the checkpoint files.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch

from .config import VOLATILE, TrainConfig, default_name
from .errors import CheckpointError, RunBusy, RunExists
from .metrics_file import MetricsWriter, read_metrics
from .ownership import LOCK, MARKER, RUN_FORMAT, RunLock, atomic_write, check_run_name, is_run, prepare_dir, run_job

__all__ = ["CKPT_FORMAT", "CheckpointError", "MetricsWriter", "RunBusy", "RunDir", "RunExists", "RunLock",
           "TrainConfig", "check_run_name", "is_run", "read_metrics",
           # re-exported from the parts
           "LOCK", "MARKER", "RUN_FORMAT", "default_name", "load_checkpoint", "prepare_dir", "run_job",
           "save_checkpoint"]

CKPT_FORMAT = "sparsync-train-checkpoint/1"
_TMP_RE = re.compile(r"\.tmp\d+$")  # what atomic_write / save_checkpoint leave when killed
_STEP_RE = re.compile(r"^step_(\d+)$")
# private names of this module before it was split into parts
_atomic_write, _VOLATILE = atomic_write, VOLATILE


class RunDir:
    """One run's directory; created by the launcher process (rank 0 appends metrics). A RunDir made
    by :meth:`prepare` holds the run's lock until :meth:`release` (or until the process ends)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lock: RunLock | None = None

    # ------------------------------------------------------------------ set-up
    @classmethod
    def prepare(cls, cfg: TrainConfig, force: bool = False, resume: bool = False,
                job: str | None = None) -> tuple[RunDir, dict | None]:
        """Create (or reopen for ``resume``) ``runs_dir/name`` and lock it; returns (run dir, resume
        info or None). ``job``: the torchrun job creating it (recorded in the marker). A start that
        fails (a full disk: the error names the file) leaves no new directory and no lock behind
        (:meth:`RunLock.abandon`)."""
        check_run_name(cfg.name)
        rd = cls(Path(cfg.runs_dir) / cfg.name)
        if not resume:
            rd.lock = prepare_dir(rd.path, "train", force, job=job)
            try:
                rd.write_config(cfg)
                atomic_write(rd.path / "metrics.jsonl", "")  # a failed write names the file
            except BaseException:
                rd.lock.abandon(("config.json", "metrics.jsonl"))  # no directory, no lock file left
                rd.lock = None
                raise
            return rd, None
        if not rd.path.is_dir() or rd.path.is_symlink():
            raise CheckpointError(f"--resume: run directory {rd.path} does not exist (nothing to resume)")
        rd.lock = RunLock(rd.path).acquire()
        try:
            return rd, rd._reopen(cfg)
        except BaseException:
            rd.release()
            raise

    def _reopen(self, cfg: TrainConfig) -> dict:
        """``--resume`` under the lock: check the latest checkpoint belongs to ``cfg`` and is not past
        ``cfg.steps``, drop what came after it; returns the resume info."""
        step = self.latest_step()
        if step is None:
            raise CheckpointError(f"--resume: {self.path} has no complete checkpoint "
                                  f"(run with --checkpoint-every N, or the run ended before its first save)")
        if cfg.steps is not None and cfg.steps < step:
            raise CheckpointError(f"--resume --steps {cfg.steps}: the latest checkpoint of {self.path} already "
                                  f"holds step {step}; pass --steps {step} or more to continue it")
        old = self.read_config()
        if old is not None and old.fingerprint() != cfg.fingerprint():
            diff = sorted(k for k, v in cfg.to_dict().items()
                          if k not in VOLATILE and old.to_dict().get(k) != v)
            raise CheckpointError(f"--resume: {self.path} was created with a different configuration "
                                  f"(differs in: {', '.join(diff)}); refusing to mix them")
        self.verify_checkpoint(step, cfg)
        self.remove_incomplete()
        self.truncate_metrics(step)
        self.write_config(cfg)
        return {"step": step, "dir": str(self.ckpt_dir(step))}

    def release(self) -> None:
        """Give the run's lock back (after the run; idempotent)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ------------------------------------------------------------------ files
    def write_config(self, cfg: TrainConfig) -> None:
        d = cfg.to_dict()
        d["fingerprint"] = cfg.fingerprint()
        atomic_write(self.path / "config.json", json.dumps(d, indent=2, sort_keys=True, default=str))

    def read_config(self) -> TrainConfig | None:
        p = self.path / "config.json"
        if not p.exists():
            return None
        return TrainConfig.from_dict(json.loads(p.read_text()))

    def metrics(self) -> list[dict]:
        return read_metrics(self.path / "metrics.jsonl")

    def metrics_writer(self) -> MetricsWriter:
        return MetricsWriter(self.path / "metrics.jsonl")

    def truncate_metrics(self, step: int) -> None:
        """Keep the records of steps < ``step`` (the checkpoint was taken after ``step`` steps)."""
        keep = [m for m in self.metrics() if m.get("step", 0) < step]
        atomic_write(self.path / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in keep))

    def write_summary(self, summary: dict) -> None:
        atomic_write(self.path / "summary.json", json.dumps(summary, indent=2, sort_keys=True, default=str))

    def summary(self) -> dict | None:
        p = self.path / "summary.json"
        return json.loads(p.read_text()) if p.exists() else None

    # ------------------------------------------------------------------ checkpoints
    def ckpt_dir(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step_{step:06d}"

    def latest_step(self) -> int | None:
        p = self.path / "checkpoints" / "latest"
        if not p.exists():
            return None
        try:
            return int(p.read_text().strip())
        except ValueError:
            raise CheckpointError(f"{p} is corrupt (expected a step number)") from None

    def mark_latest(self, step: int, keep: int = 0) -> None:
        """Make checkpoint ``step`` the one ``--resume`` uses; then keep only the newest ``keep``."""
        atomic_write(self.path / "checkpoints" / "latest", f"{step}\n")
        if keep and keep > 0:
            for old in self.checkpoint_steps()[:-keep]:
                if old != step:  # never the one ``latest`` names
                    shutil.rmtree(self.ckpt_dir(old), ignore_errors=True)

    def checkpoint_steps(self) -> list[int]:
        """Steps of the checkpoint directories on disk, ascending (complete or not)."""
        d = self.path / "checkpoints"
        if not d.is_dir():
            return []
        return sorted(int(m.group(1)) for m in (_STEP_RE.match(x.name) for x in d.iterdir() if x.is_dir()) if m)

    def remove_incomplete(self) -> list[Path]:
        """Remove temp files of killed writes and checkpoint directories newer than ``latest`` (saves
        that never completed). Only the launcher (rank 0 under torchrun) calls it, while no rank
        writes. Returns what was removed."""
        gone = []
        if not self.path.is_dir():
            return gone
        for f in self.path.rglob("*.tmp*"):
            if _TMP_RE.search(f.name) and f.is_file():
                f.unlink(missing_ok=True)
                gone.append(f)
        try:
            latest = self.latest_step()
        except CheckpointError:
            latest = None
        for step in self.checkpoint_steps():
            if latest is None or step > latest:
                shutil.rmtree(self.ckpt_dir(step), ignore_errors=True)
                gone.append(self.ckpt_dir(step))
        return gone

    def verify_checkpoint(self, step: int, cfg: TrainConfig) -> None:
        """Open every rank's file of checkpoint ``step`` and check it belongs to ``cfg``."""
        for r in range(cfg.workers):
            load_checkpoint(self.ckpt_dir(step) / f"rank{r}.pt", cfg, r)


def save_checkpoint(path: Path, cfg: TrainConfig, rank: int, step: int, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"format": CKPT_FORMAT, "fingerprint": cfg.fingerprint(), "world_size": cfg.workers,
            "rank": rank, "step": step, **state}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        torch.save(blob, tmp)
        os.replace(tmp, path)
    except OSError as e:  # a full disk (ENOSPC), quota, read-only: the previous checkpoint stays in charge
        tmp.unlink(missing_ok=True)
        raise CheckpointError(_save_failed(path, e)) from None
    except RuntimeError as e:  # torch's zip writer reports a short write as RuntimeError
        tmp.unlink(missing_ok=True)
        raise CheckpointError(_save_failed(path, e)) from None


def _save_failed(path: Path, e: BaseException) -> str:
    what = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    full = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or (free is not None and free < 1 << 20)
    hint = f" (disk full? {free} bytes free there)" if full else ""
    return (f"could not write checkpoint {path}: {what}{hint}; the previous complete checkpoint "
            f"(checkpoints/latest) stays the one --resume uses")


def load_checkpoint(path: Path, cfg: TrainConfig, rank: int) -> dict:
    """Load and validate one rank's checkpoint; a clear CheckpointError for anything wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing (incomplete checkpoint?)")
    try:  # weights_only: tensors and plain containers only - a crafted file cannot run code
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(?i)(unsupported global[^\n]*)", str(e))  # an object torch refused to build
        if found is None:  # not a refused object: the bytes are just not a checkpoint
            raise CheckpointError(f"checkpoint {path} is corrupt or not a sparsync checkpoint "
                                  f"(UnpicklingError)") from None
        raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain data; refusing "
                              f"to load it (it could run code): {found.group(1)[:200]}") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means corrupt
        raise CheckpointError(f"checkpoint {path} is corrupt or not a sparsync checkpoint "
                              f"({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(blob, dict) or blob.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {CKPT_FORMAT} file")
    if blob.get("fingerprint") != cfg.fingerprint():
        raise CheckpointError(f"checkpoint {path} belongs to a different configuration "
                              f"(fingerprint {blob.get('fingerprint')} != {cfg.fingerprint()})")
    if blob.get("world_size") != cfg.workers or blob.get("rank") != rank:
        raise CheckpointError(f"checkpoint {path} was written by rank {blob.get('rank')} of "
                              f"{blob.get('world_size')}, expected rank {rank} of {cfg.workers}")
    kinds = {"step": int, "model": dict, "optimizer": dict, "loop": dict}
    bad = [k for k, t in kinds.items() if not isinstance(blob.get(k), t)]
    if bad:
        raise CheckpointError(f"checkpoint {path} is malformed (missing or wrong type: {', '.join(bad)})")
    return blob
