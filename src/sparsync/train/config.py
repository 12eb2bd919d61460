"""``TrainConfig``: one training configuration, its defaults, its fingerprint and its label.

The fingerprint hashes every field that determines the trajectory of a run (not the step budget,
name, network, limits: :data:`VOLATILE`), so a checkpoint can be matched to the run that resumes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields

__all__ = ["VOLATILE", "TrainConfig", "default_name"]

#: fields that do not change the trajectory of a run (may differ between a run and its resume)
VOLATILE = {"name", "runs_dir", "steps", "checkpoint_every", "progress", "network", "rate_schedule", "force",
             "resume", "target_accuracy", "target_loss", "timeout", "time_limit", "final_checkpoint",
             "keep_checkpoints", "stop_at_target"}


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
    stop_at_target: bool = False      # end the run at the first evaluation that reaches the target

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
        d = {k: v for k, v in self.to_dict().items() if k not in VOLATILE}
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
