"""The global-batch schedule shared by every trainer (thesis Algorithm 1 with a fixed *global* batch):
each epoch one permutation seeded by (seed, epoch), cut into global batches, and worker ``r`` of ``P``
takes the contiguous slice ``[r b/P, (r+1) b/P)`` of each. Nothing depends on ``P`` but the slice, so
every worker count (and every aggregation strategy) walks the same samples in the same steps."""

from __future__ import annotations

import time

import torch

__all__ = ["batches", "straggle", "worker_slice"]

#: Seed mixing of (seed, epoch, step) into one generator seed: distinct primes, so the seeds are
#: distinct while ``epoch < _EPOCH_MIX`` and ``step < _STEP_MIX`` (beyond, two draws may share a seed:
#: harmless for a shuffle or a straggler draw, they are only meant to differ between steps).
_EPOCH_MIX, _STEP_MIX = 7919, 1_000_003


def worker_slice(n: int, r: int, P: int) -> tuple[int, int]:
    """Worker ``r``'s ``[lo, hi)`` of ``n`` items split into ``P`` contiguous near-equal slices."""
    return r * n // P, (r + 1) * n // P


def batches(n: int, global_batch: int, seed: int, epoch: int):
    """The epoch's global batches: a permutation of ``range(n)`` cut into ``global_batch`` pieces."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) * _EPOCH_MIX + epoch))
    return perm.split(global_batch)


def straggle(ms: float, seed: int, epoch: int, step: int, worker: int, workers: int) -> None:
    """Heterogeneous-cluster emulation (``train-linear --straggler-ms``): at every step one worker,
    drawn uniformly at random from (seed, epoch, step) — the same draw on every rank — sleeps ``ms``
    milliseconds after computing its gradient. A synchronous strategy waits for it at every step; a
    parameter server with staleness ``s > 0`` lets the others run ahead."""
    if ms > 0:
        g = torch.Generator().manual_seed((int(seed) * _EPOCH_MIX + epoch) * _STEP_MIX + step)
        if int(torch.randint(workers, (1,), generator=g)) == worker:
            time.sleep(ms / 1000.0)
