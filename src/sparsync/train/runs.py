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

Ownership and concurrency: a run name is one path component (:func:`check_run_name`: no ``/``, not
``.``, ``..`` or empty), so a run never lands outside ``runs_dir``. A run directory carries a marker
file (``.sparsync-run``) from its creation on, and ``--force`` empties only a directory that has it
(:func:`is_run`): never a directory sparsync did not make. Every writer holds an advisory lock
(``fcntl.flock`` on ``<run>/.lock``, :class:`RunLock`) from preparing the directory to the end of
the run; a second writer (a second ``--resume``, a ``--force`` on a live run) gets :class:`RunBusy`
naming the holder's pid. ``--force`` empties the directory but keeps the lock file, so the lock
stays one file for the directory's whole life.

Metrics: one JSON object per line, each written with a single ``write`` on an ``O_APPEND`` file
(:class:`MetricsWriter`), so a write cut short (a full disk, a kill) can only tear the last line;
:func:`read_metrics` drops a torn last line with a warning naming the file, and a failed write
raises an ``OSError`` naming the file.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

__all__ = ["CKPT_FORMAT", "CheckpointError", "MetricsWriter", "RunBusy", "RunDir", "RunExists", "RunLock",
           "TrainConfig", "check_run_name", "is_run", "read_metrics"]

CKPT_FORMAT = "sparsync-train-checkpoint/1"
RUN_FORMAT = "sparsync-run/1"
MARKER = ".sparsync-run"   # written when a run (or a comparison) directory is created
LOCK = ".lock"             # the advisory lock file of a run directory (kept by --force)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not belong to this run."""


class RunExists(RuntimeError):
    """The run directory exists and neither --force nor --resume was given (or --force was given
    for a directory that is not a sparsync run)."""


class RunBusy(RunExists):
    """Another live process writes this run directory (it holds the run's lock)."""


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

    def acquire(self) -> RunLock:
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunBusy(f"{self.what} {self.path} is in use by another sparsync process (pid {holder}); "
                          "wait for it to end, or pick another --name") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    close = release  # contextlib.closing


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
    path.mkdir(parents=True, exist_ok=True)
    lock = RunLock(path, what).acquire()
    try:
        if refuse_unless_ours():  # again under the lock: another process may have written meanwhile
            _clear(path)
        _atomic_write(path / MARKER, json.dumps({"format": RUN_FORMAT, "kind": kind, "job": job}))
    except BaseException:
        lock.release()
        raise
    return lock


def run_job(path) -> str | None:
    """The torchrun job recorded in a run directory's marker (None: none, or no marker)."""
    m = _marker(Path(path))
    return m.get("job") if m else None


def read_metrics(path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (missing file: none). A torn last line - a write cut short
    by a full disk or a kill - is dropped with a warning naming the file; an unreadable line before
    the last is a :class:`CheckpointError` naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if not any(x.strip() for x in lines[i + 1:]):  # the last line: torn
                warnings.warn(f"{path}: ignoring its torn last line (a write cut short, e.g. by a full disk): "
                              f"{line[:60]!r}", RuntimeWarning, stacklevel=2)
                break
            raise CheckpointError(f"{path} line {i + 1} is not a metrics record ({e}); "
                                  "the file is damaged") from None
        out.append(rec)
    return out


class MetricsWriter:
    """Appends one record per line to ``metrics.jsonl``: each line one ``os.write`` on an
    ``O_APPEND`` descriptor (a cut-short write tears only the last line, which :func:`read_metrics`
    drops); a failed write raises ``OSError`` with the file named (a full disk says where)."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def write(self, rec: dict) -> None:
        data = (json.dumps(rec) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} (writing the metrics file)", str(self.path)) from None

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


#: fields that do not change the trajectory of a run (may differ between a run and its resume)
_VOLATILE = {"name", "runs_dir", "steps", "checkpoint_every", "progress", "network", "rate_schedule", "force",
             "resume", "target_accuracy", "target_loss", "timeout", "time_limit", "final_checkpoint",
             "keep_checkpoints"}
_TMP_RE = re.compile(r"\.tmp\d+$")  # what _atomic_write / save_checkpoint leave when killed
_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass
class TrainConfig:
    """One training configuration (``sparsync train`` arguments after defaults are filled in)."""

    workload: str = "digits-mlp"
    reducer: str = "dense"            # a registered reducer, or "ddp" / "ddp-fp16" (torch's own DDP)
    density: float = 0.01
    merge: str = "single"
    reducer_options: dict = field(default_factory=dict)
    workload_options: dict = field(default_factory=dict)
    ddp_options: dict = field(default_factory=dict)   # extra SparseDDP keywords (nonfinite, unused, ...)
    convergence: dict = field(default_factory=dict)   # sparsync.convergence.GradientPolicy options
    local_steps: dict = field(default_factory=dict)   # DiLoCo (sync_every, outer_lr, ...) / post-local SGD warmup
    workers: int = 4
    steps: int | None = None
    epochs: float | None = None
    batch_size: int | None = None     # per worker
    lr: float | None = None
    optimizer: str | None = None      # sgd | momentum | nesterov | adam | adamw (sparsync.train.optim)
    momentum: float = 0.9
    weight_decay: float | None = None  # default: the workload's, else 0
    lr_warmup: int | None = None      # linear learning-rate warm-up steps (default: the workload's, else 0)
    lr_schedule: str | None = None    # constant | cosine (default: the workload's, else constant)
    adam_freeze: int = 0              # adamw: freeze the second moment after N steps (0: off; sparsync.adam)
    target_accuracy: float | None = None  # reached at or above (higher is better) ...
    target_loss: float | None = None  # ... or the held-out loss reached at or below; one of them
    eval_every: int | None = None
    seed: int = 0
    name: str | None = None
    runs_dir: str = "runs"
    checkpoint_every: int = 0
    keep_checkpoints: int = 2         # newest complete checkpoints kept (0 = all)
    final_checkpoint: bool = True     # compare turns it off (each rank's file is ~50 MB for digits-mlp)
    network: str = "loopback"         # loopback | 1gbit (any tc rate) | 2x2@10gbit/200mbit (sites) | thread
    rate_schedule: str = ""           # "STEP:RATE,...": the emulated inter-host rate changes at STEP
    progress: bool = True
    timeout: float = 600.0            # stall timeout: seconds without a completed step (run_local)
    time_limit: float | None = None   # whole-run limit in seconds (None: none)

    def fill_defaults(self, workload) -> TrainConfig:
        d = workload.defaults
        for k in ("batch_size", "lr", "optimizer", "eval_every"):
            if getattr(self, k) is None:
                setattr(self, k, d[k])
        for k, fallback in (("weight_decay", 0.0), ("lr_warmup", 0), ("lr_schedule", "constant")):
            if getattr(self, k) is None:
                setattr(self, k, d.get(k, fallback))
        if self.target_accuracy is None and self.target_loss is None:  # a target given replaces the workload's
            self.target_accuracy, self.target_loss = d.get("target_accuracy"), d.get("target_loss")
        if self.steps is None:
            if self.epochs is not None:
                spe = workload.steps_per_epoch(self.workers, self.batch_size)
                self.steps = max(1, round(self.epochs * spe))
            else:
                self.steps = d["steps"]
        if self.name is None:
            self.name = default_name(self)
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    def target_reached(self, ev: dict) -> bool:
        """Whether an evaluation (``{"accuracy", "loss", ...}``) meets the run's target: the held-out
        loss at or below ``target_loss`` when that is set, else accuracy at or above ``target_accuracy``."""
        if self.target_loss is not None:
            return ev["loss"] <= self.target_loss
        return self.target_accuracy is not None and ev["accuracy"] >= self.target_accuracy

    def target_text(self) -> str:
        """The target in words, e.g. ``held-out loss <= 2.1`` or ``accuracy >= 0.95``."""
        if self.target_loss is not None:
            return f"held-out loss <= {self.target_loss:g}"
        return "no target" if self.target_accuracy is None else f"accuracy >= {self.target_accuracy:g}"

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def fingerprint(self) -> str:
        """Hash of everything that determines the trajectory (not the step budget, name, network)."""
        d = {k: v for k, v in self.to_dict().items() if k not in _VOLATILE}
        if not d["local_steps"]:  # runs without local steps keep the fingerprint they had before the field
            del d["local_steps"]
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def is_torch_ddp(self) -> bool:
        return self.reducer == "ddp" or self.reducer.startswith("ddp-")  # ddp-fp16, ddp-powersgd<rank>

    def label(self) -> str:
        if self.local_steps or self.reducer.startswith("ddp-localsgd"):
            from ..localsteps.trainer import label

            return label(self, self._label())
        return self._label()

    def _label(self) -> str:
        if self.is_torch_ddp:
            return "torch " + self.reducer
        if self.reducer == "nocomm":
            return "no-comm floor"
        # reducer options too: two rows differing only there must not share a label
        conv = "".join(f", {k}={v:g}" if isinstance(v, float) else f", {k}={v}"
                       for k, v in sorted({**self.reducer_options, **self.convergence,
                                           **_labelled(self.ddp_options),
                                           **({"adam_freeze": self.adam_freeze} if self.adam_freeze else {})}.items()))
        if self.reducer in ("dense", "auto"):  # no density: dense sends everything, auto picks its own
            return f"{self.reducer} ({self.merge}{conv})"
        return f"{self.reducer} {self.density:g} ({self.merge}{conv})"


def _labelled(ddp_options: dict) -> dict:
    """The SparseDDP keywords that change what a run computes, for its label (delayed averaging)."""
    return {k: v for k, v in ddp_options.items() if k == "delay" and v}


def default_name(cfg: TrainConfig) -> str:
    r = cfg.reducer if cfg.is_torch_ddp or cfg.reducer == "dense" else f"{cfg.reducer}-{cfg.density:g}"
    if cfg.local_steps.get("sync_every"):
        r = f"diloco{cfg.local_steps['sync_every']}-{r}"
    return f"{cfg.workload}-{r}-{cfg.merge.replace(':', '')}-P{cfg.workers}-s{cfg.seed}"


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
        info or None). ``job``: the torchrun job creating it (recorded in the marker)."""
        check_run_name(cfg.name)
        rd = cls(Path(cfg.runs_dir) / cfg.name)
        if not resume:
            rd.lock = prepare_dir(rd.path, "train", force, job=job)
            try:
                rd.write_config(cfg)
                (rd.path / "metrics.jsonl").write_text("")
            except BaseException:
                rd.release()
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
                          if k not in _VOLATILE and old.to_dict().get(k) != v)
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
        _atomic_write(self.path / "config.json", json.dumps(d, indent=2, sort_keys=True, default=str))

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
        _atomic_write(self.path / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in keep))

    def write_summary(self, summary: dict) -> None:
        _atomic_write(self.path / "summary.json", json.dumps(summary, indent=2, sort_keys=True, default=str))

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
        _atomic_write(self.path / "checkpoints" / "latest", f"{step}\n")
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


def _atomic_write(path: Path, text: str) -> None:
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
