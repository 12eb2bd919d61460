"""A Lightning Callback that puts a sparsync reducer on the DDP model of ``Trainer(strategy="ddp")``.

::

    from sparsync.integrations.lightning import SparsyncCallback
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2,
                        callbacks=[SparsyncCallback("micro", density=0.01)])

* ``on_fit_start``: creates a :func:`sparsync.ddp_hook` and registers it on the strategy's
  ``DistributedDataParallel`` model, on CPU and GPU alike (``DDPStrategy(ddp_comm_hook=...)``
  registers a comm hook only for CUDA devices and trains dense on CPU without a word). Do not also
  pass ``ddp_comm_hook=`` (DDP takes one hook).
* ``on_save_checkpoint``: every rank's hook state in one object (the gathered form; a collective,
  and Lightning builds the checkpoint on every rank), under ``checkpoint["sparsync_hook"]`` - rank 0
  writes the file; ``on_load_checkpoint`` keeps it and ``on_fit_start`` gives each rank its own, so
  ``trainer.fit(..., ckpt_path=...)`` resumes bitwise.

Works with ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning``.
"""

from __future__ import annotations

import warnings

from . import GatheredState, register, require

try:
    import lightning.pytorch as _pl
except ImportError:
    try:
        import pytorch_lightning as _pl  # the standalone package
    except ImportError:
        _pl = require("lightning.pytorch", "lightning")  # raises, naming the package to install

CHECKPOINT_KEY = "sparsync_hook"

__all__ = ["CHECKPOINT_KEY", "SparsyncCallback"]


class SparsyncCallback(_pl.Callback):
    """Register ``ss.ddp_hook(reducer, density, **options)`` on Lightning's DDP model; save and
    restore its per-rank state in Lightning's (single-writer) checkpoint."""

    def __init__(self, reducer: str = "micro", density: float = 0.01, **options):
        from ..reducers.registry import load_all

        if reducer not in load_all():
            raise ValueError(f"unknown reducer {reducer!r}; valid: {', '.join(sorted(load_all()))}")
        self.reducer, self.density, self.options = reducer, density, options
        self.hook = None
        self._loaded = None

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if trainer.world_size == 1 and not hasattr(model, "register_comm_hook"):
            warnings.warn("SparsyncCallback: one process, no DDP model - nothing to reduce", stacklevel=2)
            return
        self.hook = register(model, self.reducer, self.density, **self.options)
        if self._loaded is not None:
            self.hook.load_state_dict(self._loaded)
            self._loaded = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.hook is not None:
            checkpoint[CHECKPOINT_KEY] = GatheredState(self.hook).state_dict()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Lightning restores callbacks before on_fit_start (the hook does not exist yet)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None and self.hook is not None:
            self.hook.load_state_dict(state)
        else:
            self._loaded = state
