"""Data-parallel mini-batch SGD for sparse linear models (SparCML's MPI-SGD, thesis §4.2).

Thesis Algorithm 1 with a fixed *global* batch: every epoch all ranks draw the same permutation
(seeded by ``seed`` and the epoch), cut it into global batches of ``global_batch`` samples, and rank
``r`` of ``P`` takes the contiguous slice ``[r*b//P, (r+1)*b//P)`` of each batch. Each rank computes
the *sum* of its samples' gradients (sparse: only the features present in its slice), a lossless
sparse all-reduce (``algorithm``: any name of :mod:`sparsync.collectives`, ``"ps"`` for the
synchronous parameter server of :mod:`sparsync.ps` (option ``servers``), or ``"dense"`` for a
dense all-reduce) sums them, and every rank applies ``w <- w - lr/b * sum`` (plus an optional dense
L2 shrink ``w <- w (1 - lr*l2)``, applied identically everywhere). Because the global batch and the
permutation do not depend on ``P``, 1, 2 or 4 workers follow the same trajectory up to the
floating-point order of the summation. ``"ps-async"`` trains through the asynchronous parameter server
with bounded staleness instead (options ``servers``, ``staleness``; :mod:`.ps_async`).

Per epoch it records train loss/accuracy and test accuracy (each rank evaluates its shard; three
numbers are summed with an unrecorded all-reduce), the wall time spent computing (gradients,
updates) and communicating (the all-reduce), and the ledger bytes.
"""

from __future__ import annotations

import time

import torch

from ..collectives.auto import with_own_state
from ..collectives.registry import load_all
from ..ps import apply_update, ps_allreduce
from .batching import batches, straggle, worker_slice
from .data import SparseDataset
from .models import MODELS, batch_gradient, evaluate
from .ps_async import train_ps_async

__all__ = ["train"]


def _metrics(comm, model, ds, w):
    if ds is None or ds.n_samples == 0:
        return None
    lo, hi = worker_slice(ds.n_samples, comm.rank, comm.world_size)
    loss, correct, cnt = evaluate(model, ds, torch.arange(lo, hi), w)
    t = torch.tensor([loss, correct, cnt], dtype=torch.float64)
    if comm.world_size > 1:
        with comm.unrecorded():
            t = comm.allreduce(t)
    return float(t[0] / t[2]), float(t[1] / t[2])


def train(comm, train_ds: SparseDataset, model: str = "logreg", epochs: int = 5, global_batch: int = 1000,
          lr: float = 0.5, l2: float = 0.0, algorithm: str = "auto", seed: int = 0, test_ds=None,
          dtype=torch.float32, log=None, straggler_ms: float = 0.0, **algo_options) -> dict:
    """Train on ``comm``'s ranks; returns ``{"w", "history"}`` (identical ``w`` on every rank).
    ``straggler_ms``: one random worker per step sleeps that long (:func:`.batching.straggle`).
    ``algorithm="auto"`` keeps one :class:`~sparsync.collectives.auto.AutoState` for the whole run
    (the option ``state=``, else a fresh one)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    algos = dict(load_all())
    algos["ps"] = ps_allreduce  # the parameter-server baseline (option ``servers``)
    if algorithm not in ("dense", "ps-async") and algorithm not in algos:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: dense, ps-async, {', '.join(sorted(algos))}")
    if global_batch < comm.world_size:
        raise ValueError(f"global_batch ({global_batch}) must be >= the number of workers ({comm.world_size})")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if algorithm == "ps-async":
        return train_ps_async(comm, train_ds, model, epochs, global_batch, lr, l2, seed, test_ds, dtype, log,
                              straggler_ms=straggler_ms, **algo_options)
    algo_options = with_own_state(algorithm, algo_options)  # auto: calibrated and measured once, then kept
    N = train_ds.n_features
    w = torch.zeros(N, dtype=dtype)
    history = []
    for epoch in range(epochs):
        compute_s = comm_s = 0.0
        picked: dict[str, int] = {}
        snap = comm.ledger.snapshot()
        for i, batch in enumerate(batches(train_ds.n_samples, global_batch, seed, epoch)):
            t0 = time.perf_counter()
            b = batch.numel()
            lo, hi = worker_slice(b, comm.rank, comm.world_size)
            g = batch_gradient(model, train_ds, batch[lo:hi], w)
            straggle(straggler_ms, seed, epoch, i, comm.rank, comm.world_size)
            t1 = time.perf_counter()
            if algorithm == "dense":
                total = comm.allreduce(g.to_dense())
            elif comm.world_size == 1:
                total = g
            else:
                info = {}
                opts = algo_options if algorithm == "ps" else {"report": info, **algo_options}
                total = algos[algorithm](g, comm, **opts)
                if algorithm == "auto":
                    picked[info["algorithm"]] = picked.get(info["algorithm"], 0) + 1
            t2 = time.perf_counter()
            if l2:
                w.mul_(1.0 - lr * l2)
            apply_update(w, total, lr / b)
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
