"""The Accelerate recipe: a sparsync hook on the prepared model, its state in ``save_state``.

Launch with ``torchrun --nproc-per-node N train.py`` (``accelerate launch --cpu --num_processes 2``
starts a single process on CPU). ``DistributedDataParallelKwargs(comm_hook=...)`` takes only
torch's built-in hooks, so register on the prepared model instead::

    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    hook = sparsync.integrations.accelerate.register(accelerator, model, "micro", density=0.01)
    ...
    accelerator.save_state(dir)     # every rank's hook state, written by the main process
    accelerator.load_state(dir)     # each rank takes its own

:func:`register` registers the hook (on its own process group) and
``accelerator.register_for_checkpointing`` of its gathered state (:class:`GatheredState`), so call
it on every process, in the same order relative to other registered objects.
"""

from __future__ import annotations

from . import GatheredState, require
from . import register as _register_hook

require("accelerate", "accelerate")

__all__ = ["register"]


def register(accelerator, model, reducer: str = "micro", density: float = 0.01, **options):
    """Register ``ss.ddp_hook(reducer, density, **options)`` on the prepared DDP ``model`` and its
    gathered state for ``accelerator.save_state`` / ``load_state``; returns the hook."""
    hook = _register_hook(model, reducer, density, **options)
    accelerator.register_for_checkpointing(GatheredState(hook))
    return hook
