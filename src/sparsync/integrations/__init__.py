"""sparsync inside the trainers people use: Lightning (:mod:`.lightning`), Accelerate
(:mod:`.accelerate`), the Hugging Face Trainer (:mod:`.hf`). Each submodule imports its client when
it is imported; this package imports none. Guide: ``docs/integrations.md``.

What they share: a :class:`~sparsync.commhook.DDPHook` registered on the DDP model the trainer built
(on its own process group, so ``find_unused_parameters=True`` - the HF Trainer's default - is safe),
and its per-rank state saved in the **gathered form** (every rank's state in one object,
:mod:`sparsync.rankstate`), because each of these trainers writes its checkpoint from one rank.
"""

from __future__ import annotations

import importlib


def register(ddp_model, reducer: str = "micro", density: float = 0.01, **options):
    """Create a sparsync comm hook and register it on ``ddp_model`` (a torch
    ``DistributedDataParallel``); returns the hook. ``TypeError`` (one line) for anything else."""
    from torch.nn.parallel import DistributedDataParallel

    from ..commhook import ddp_hook

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"sparsync needs the trainer's DistributedDataParallel model, got {type(ddp_model).__name__} "
                        "(a DDP strategy with more than one process)")
    hook = ddp_hook(reducer, density, module=ddp_model, **options)
    ddp_model.register_comm_hook(None, hook)
    return hook


class GatheredState:
    """A hook's state in the gathered form, for a trainer that checkpoints objects with
    ``state_dict()`` / ``load_state_dict()`` from one rank (``accelerate``'s
    ``register_for_checkpointing``). ``state_dict()`` is a collective: every rank calls it, as
    ``Accelerator.save_state`` does."""

    def __init__(self, hook):
        self.hook = hook

    def state_dict(self) -> dict:
        return self.hook.gathered_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.hook.load_state_dict(state)


def require(module: str, pip_name: str):
    """Import the client ``module`` or raise ImportError in one line naming the pip package."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"this sparsync integration needs {pip_name!r}: pip install {pip_name} "
                          f"(with your torch pinned, e.g. pip install 'torch==2.13.*' {pip_name})") from e


def load_state_file(path) -> dict:
    """A hook state written with ``torch.save`` (e.g. the HF callback's ``sparsync_hook.pt``), read
    as data only (``torch.load(..., weights_only=True)``: tensors and plain containers), so a crafted
    file cannot run code. Anything else raises a one-line ``ValueError`` naming the file."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        import re

        found = re.search(r"GLOBAL (\S+)", str(e))  # what the pickle asked for, e.g. posix.system
        why = (f"it holds {found.group(1)}" if found else
               (str(e).strip().splitlines() or [type(e).__name__])[0])
        raise ValueError(f"{path}: not a sparsync hook state (only tensors and plain data load; {why})") from None

