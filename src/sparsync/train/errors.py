"""The refusals of run directories and checkpoints, as exception types the CLI turns into one line."""

from __future__ import annotations

__all__ = ["CheckpointError", "RunBusy", "RunExists"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not belong to this run."""


class RunExists(RuntimeError):
    """The run directory exists and neither --force nor --resume was given (or --force was given
    for a directory that is not a sparsync run)."""


class RunBusy(RunExists):
    """Another live process writes this run directory (it holds the run's lock)."""
