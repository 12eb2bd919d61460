"""A Hugging Face ``Trainer`` callback that puts a sparsync reducer on the Trainer's DDP model.

::

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    sparsync.integrations.hf.attach(trainer, "micro", density=0.01)
    trainer.train()                                   # or train(resume_from_checkpoint=...)

Launch with ``torchrun``. The Trainer wraps the model in DDP with ``find_unused_parameters=True``
unless ``ddp_find_unused_parameters=False``: the hook runs on its own process group, so that is safe.

* ``on_train_begin`` (after the Trainer built its DDP model and loaded a checkpoint): registers the
  hook on ``trainer.model_wrapped``; when the run resumed (``state.global_step > 0``) it loads
  ``sparsync_hook.pt`` from ``<output_dir>/checkpoint-<global_step>`` (or ``resume_from``).
* ``on_train_end``: stops the hook's communication thread (the hook stays readable).
* ``on_save`` (every rank, after the Trainer wrote ``checkpoint-<step>``): gathers every rank's hook
  state and the main process writes it there as ``sparsync_hook.pt``, so checkpoint rotation
  (``save_total_limit``) removes it with the rest.
"""

from __future__ import annotations

import os
import warnings

import torch

from . import GatheredState, load_state_file, register, require

_tf = require("transformers", "transformers")

FILE_NAME = "sparsync_hook.pt"

__all__ = ["FILE_NAME", "SparsyncTrainerCallback", "attach"]


class SparsyncTrainerCallback(_tf.TrainerCallback):
    """See the module docstring; create it with :func:`attach` (it needs the trainer)."""

    def __init__(self, trainer, reducer: str = "micro", density: float = 0.01, resume_from: str | None = None,
                 **options):
        from ..reducers.registry import load_all

        if reducer not in load_all():
            raise ValueError(f"unknown reducer {reducer!r}; valid: {', '.join(sorted(load_all()))}")
        self.trainer, self.reducer, self.density, self.options = trainer, reducer, density, options
        self.resume_from = resume_from
        self.hook = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if args.world_size == 1 and not hasattr(model, "register_comm_hook"):
            warnings.warn("SparsyncTrainerCallback: one process, no DDP model - nothing to reduce", stacklevel=2)
            return
        self.hook = register(model, self.reducer, self.density, **self.options)
        if state.global_step > 0:
            folder = self.resume_from or os.path.join(args.output_dir, f"{_tf.trainer_utils.PREFIX_CHECKPOINT_DIR}-"
                                                      f"{state.global_step}")
            path = os.path.join(folder, FILE_NAME)
            if os.path.isfile(path):
                self.hook.load_state_dict(load_state_file(path))  # data only: a crafted file runs nothing
            else:
                warnings.warn(f"SparsyncTrainerCallback: resumed at step {state.global_step} but {path} does not "
                              "exist: the hook starts with empty residuals (pass resume_from=)", stacklevel=2)

    def on_train_end(self, args, state, control, **kwargs):
        """Stop the hook's communication thread once training ends (it stays registered and readable):
        a thread still inside a collective when the process exits aborts it."""
        if self.hook is not None:
            self.hook.close()

    def on_save(self, args, state, control, **kwargs):
        if self.hook is None:
            return
        gathered = GatheredState(self.hook).state_dict()  # collective: every rank is here
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"{_tf.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(gathered, os.path.join(folder, FILE_NAME))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


def attach(trainer, reducer: str = "micro", density: float = 0.01, resume_from: str | None = None,
           **options) -> SparsyncTrainerCallback:
    """Add a :class:`SparsyncTrainerCallback` to ``trainer``; returns it (its ``.hook`` after train starts)."""
    cb = SparsyncTrainerCallback(trainer, reducer, density, resume_from=resume_from, **options)
    trainer.add_callback(cb)
    return cb
