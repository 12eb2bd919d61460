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
whose config fingerprint / world size / rank differs from the run's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

__all__ = ["CKPT_FORMAT", "CheckpointError", "RunDir", "RunExists", "TrainConfig"]

CKPT_FORMAT = "sparsync-train-checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not belong to this run."""


class RunExists(RuntimeError):
    """The run directory exists and neither --force nor --resume was given."""


#: fields that do not change the trajectory of a run (may differ between a run and its resume)
_VOLATILE = {"name", "runs_dir", "steps", "checkpoint_every", "progress", "network", "rate_schedule", "force", "resume",
             "target_accuracy", "timeout", "final_checkpoint", "keep_checkpoints"}
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
    workers: int = 4
    steps: int | None = None
    epochs: float | None = None
    batch_size: int | None = None     # per worker
    lr: float | None = None
    optimizer: str | None = None      # sgd | momentum | nesterov | adam
    momentum: float = 0.9
    target_accuracy: float | None = None
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
    timeout: float = 600.0

    def fill_defaults(self, workload) -> TrainConfig:
        d = workload.defaults
        for k in ("batch_size", "lr", "optimizer", "target_accuracy", "eval_every"):
            if getattr(self, k) is None:
                setattr(self, k, d[k])
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

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def fingerprint(self) -> str:
        """Hash of everything that determines the trajectory (not the step budget, name, network)."""
        d = {k: v for k, v in self.to_dict().items() if k not in _VOLATILE}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @property
    def is_torch_ddp(self) -> bool:
        return self.reducer == "ddp" or self.reducer.startswith("ddp-")  # ddp-fp16, ddp-powersgd<rank>

    def label(self) -> str:
        if self.is_torch_ddp:
            return "torch " + self.reducer
        if self.reducer == "nocomm":
            return "no-comm floor"
        # reducer options too: two rows differing only there must not share a label
        conv = "".join(f", {k}={v:g}" if isinstance(v, float) else f", {k}={v}"
                       for k, v in sorted({**self.reducer_options, **self.convergence,
                                           **_labelled(self.ddp_options)}.items()))
        if self.reducer == "dense":
            return f"dense ({self.merge}{conv})"
        return f"{self.reducer} {self.density:g} ({self.merge}{conv})"


def _labelled(ddp_options: dict) -> dict:
    """The SparseDDP keywords that change what a run computes, for its label (delayed averaging)."""
    return {k: v for k, v in ddp_options.items() if k == "delay" and v}


def default_name(cfg: TrainConfig) -> str:
    r = cfg.reducer if cfg.is_torch_ddp or cfg.reducer == "dense" else f"{cfg.reducer}-{cfg.density:g}"
    return f"{cfg.workload}-{r}-{cfg.merge.replace(':', '')}-P{cfg.workers}-s{cfg.seed}"


class RunDir:
    """One run's directory; created by the launcher process (rank 0 appends metrics)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def prepare(cls, cfg: TrainConfig, force: bool = False, resume: bool = False) -> tuple[RunDir, dict | None]:
        """Create (or reopen for ``resume``) ``runs_dir/name``; returns (run dir, resume info or None)."""
        rd = cls(Path(cfg.runs_dir) / cfg.name)
        if resume:
            if not rd.path.exists():
                raise CheckpointError(f"--resume: run directory {rd.path} does not exist (nothing to resume)")
            step = rd.latest_step()
            if step is None:
                raise CheckpointError(f"--resume: {rd.path} has no complete checkpoint "
                                      f"(run with --checkpoint-every N, or the run ended before its first save)")
            old = rd.read_config()
            if old is not None and old.fingerprint() != cfg.fingerprint():
                diff = sorted(k for k, v in cfg.to_dict().items()
                              if k not in _VOLATILE and old.to_dict().get(k) != v)
                raise CheckpointError(f"--resume: {rd.path} was created with a different configuration "
                                      f"(differs in: {', '.join(diff)}); refusing to mix them")
            rd.verify_checkpoint(step, cfg)
            rd.remove_incomplete()
            rd.truncate_metrics(step)
            rd.write_config(cfg)
            return rd, {"step": step, "dir": str(rd.ckpt_dir(step))}
        if rd.path.exists() and not rd.path.is_dir():
            raise RunExists(f"{rd.path} exists and is not a directory; pick another --name or --runs-dir")
        if rd.path.exists() and any(rd.path.iterdir()):
            if not force:
                raise RunExists(f"run directory {rd.path} already exists; pass --force to overwrite it, "
                                f"--resume to continue it, or --name to pick another name")
            shutil.rmtree(rd.path)
        rd.path.mkdir(parents=True, exist_ok=True)
        rd.write_config(cfg)
        (rd.path / "metrics.jsonl").write_text("")
        return rd, None

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
        p = self.path / "metrics.jsonl"
        if not p.exists():
            return []
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
