"""Data-parallel mini-batch SGD for sparse linear models (SparCML's MPI-SGD, ``spec/sparcml.md`` §8).

Thesis Algorithm 1 with a fixed *global* batch: every epoch all ranks draw the same permutation
(seeded by ``seed`` and the epoch), cut it into global batches of ``global_batch`` samples, and rank
``r`` of ``P`` takes the contiguous slice ``[r*b//P, (r+1)*b//P)`` of each batch. Each rank computes
the *sum* of its samples' gradients (sparse: only the features present in its slice), a lossless
sparse all-reduce (``algorithm``: any name of :mod:`sparsync.collectives`, or ``"dense"`` for a
dense all-reduce) sums them, and every rank applies ``w <- w - lr/b * sum`` (plus an optional dense
L2 shrink ``w <- w (1 - lr*l2)``, applied identically everywhere). Because the global batch and the
permutation do not depend on ``P``, 1, 2 or 4 workers follow the same trajectory up to the
floating-point order of the summation.

Per epoch it records train loss/accuracy and test accuracy (each rank evaluates its shard; three
numbers are summed with an unrecorded all-reduce), the wall time spent computing (gradients,
updates) and communicating (the all-reduce), and the ledger bytes.
"""

from __future__ import annotations

import time

import torch

from ..collectives.registry import load_all
from ..sparse import SparseVec
from .data import SparseDataset
from .models import MODELS, batch_gradient, evaluate

__all__ = ["train"]


def _shard(n: int, r: int, P: int) -> tuple[int, int]:
    return r * n // P, (r + 1) * n // P


def _metrics(comm, model, ds, w):
    if ds is None or ds.n_samples == 0:
        return None
    lo, hi = _shard(ds.n_samples, comm.rank, comm.world_size)
    loss, correct, cnt = evaluate(model, ds, torch.arange(lo, hi), w)
    t = torch.tensor([loss, correct, cnt], dtype=torch.float64)
    if comm.world_size > 1:
        with comm.unrecorded():
            t = comm.allreduce(t)
    return float(t[0] / t[2]), float(t[1] / t[2])


def train(comm, train_ds: SparseDataset, model: str = "logreg", epochs: int = 5, global_batch: int = 1000,
          lr: float = 0.5, l2: float = 0.0, algorithm: str = "auto", seed: int = 0, test_ds=None,
          dtype=torch.float32, log=None, **algo_options) -> dict:
    """Train on ``comm``'s ranks; returns ``{"w", "history"}`` (identical ``w`` on every rank)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    algos = load_all()
    if algorithm != "dense" and algorithm not in algos:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: dense, {', '.join(sorted(algos))}")
    if global_batch < comm.world_size:
        raise ValueError(f"global_batch ({global_batch}) must be >= the number of workers ({comm.world_size})")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    N = train_ds.n_features
    n = train_ds.n_samples
    w = torch.zeros(N, dtype=dtype)
    history = []
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(int(seed) * 7919 + epoch)
        perm = torch.randperm(n, generator=gen)
        compute_s = comm_s = 0.0
        picked: dict[str, int] = {}
        snap = comm.ledger.snapshot()
        for start in range(0, n, global_batch):
            t0 = time.perf_counter()
            batch = perm[start:start + global_batch]
            b = batch.numel()
            lo, hi = _shard(b, comm.rank, comm.world_size)
            g = batch_gradient(model, train_ds, batch[lo:hi], w)
            t1 = time.perf_counter()
            if algorithm == "dense":
                total = comm.allreduce(g.to_dense())
            elif comm.world_size == 1:
                total = g
            else:
                info = {}
                total = algos[algorithm](g, comm, report=info, **algo_options)
                if algorithm == "auto":
                    picked[info["algorithm"]] = picked.get(info["algorithm"], 0) + 1
            t2 = time.perf_counter()
            step = lr / b
            if l2:
                w.mul_(1.0 - lr * l2)
            if isinstance(total, SparseVec):
                w.index_add_(0, total.indices, total.values, alpha=-step)
            else:
                w.add_(total, alpha=-step)
            t3 = time.perf_counter()
            compute_s += (t1 - t0) + (t3 - t2)
            comm_s += t2 - t1
        cost = comm.ledger.since(snap)
        tr = _metrics(comm, model, train_ds, w)
        te = _metrics(comm, model, test_ds, w)
        rec = {"epoch": epoch + 1, "loss": tr[0], "train_acc": tr[1], "test_acc": te[1] if te else None,
               "compute_s": compute_s, "comm_s": comm_s, "bytes_received": cost["bytes_received"],
               "rounds": cost["rounds"], "auto_picked": picked}
        history.append(rec)
        if log is not None and comm.rank == 0:
            log(rec)
    return {"w": w, "history": history}
