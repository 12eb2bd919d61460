"""MPI-SGD through the asynchronous parameter server with bounded staleness (``train-linear
--algorithm ps-async``; SparCML thesis §4.2.2; protocol in :mod:`sparsync.ps.async_ps`).

Ranks ``0..S-1`` serve the model shards; the ``W = P - S`` workers walk the same global batches as the
synchronous trainer (:mod:`.batching`): worker ``q`` takes the slice
``[q b/W, (q+1) b/W)`` of every batch, pulls the model under the staleness rule, computes its sparse
gradient sum and pushes it. The server applies step ``t`` as ``w <- w(1 - lr l2) - lr/b_t * sum`` once
every worker pushed it, so with ``staleness = 0`` the run is bitwise the synchronous ``ps`` trainer on
``W`` ranks (tested).

At each epoch's end every worker pulls the model with *every* step of the epoch applied (a
staleness-0 pull, the thesis' ``PostEpoch``), so the epoch's metrics describe one well-defined model:
each worker evaluates the whole train and test sets on it (no collective: the servers are busy
serving). The per-epoch record adds ``lag_max`` / ``lag_mean``: how many steps behind its own clock
the model a worker computed on was (``c - min_k v_k``, at most ``s``).
"""

from __future__ import annotations

import time

import torch

from ..ps import PSClient, check_async_servers, check_staleness, serve, transport_for
from .batching import batches, straggle, worker_slice
from .models import batch_gradient, evaluate

__all__ = ["train_ps_async"]


def _metrics(model, ds, w):
    if ds is None or ds.n_samples == 0:
        return None
    loss, correct, cnt = evaluate(model, ds, torch.arange(ds.n_samples), w)
    return loss / cnt, correct / cnt


def train_ps_async(comm, train_ds, model, epochs, global_batch, lr, l2, seed, test_ds, dtype, log,
                   servers: int = 1, staleness: int = 0, ps_timeout: float = 60.0, straggler_ms: float = 0.0) -> dict:
    """One rank's part: a server returns ``{"w": its shard, "history": [], "pushes": log, "version"}``,
    a worker ``{"w": the final model, "history": [per-epoch records]}`` (identical ``w`` on every worker)."""
    S = check_async_servers(servers, comm.world_size)
    s = check_staleness(staleness)
    tr = transport_for(comm, ps_timeout)
    N = train_ds.n_features
    if tr.rank < S:
        st = serve(tr, N, S, s, lr, l2, dtype)
        return {"w": st.w, "history": [], "pushes": st.log, "version": st.version}
    client = PSClient(tr, N, S, s, dtype)
    q, W = tr.rank - S, comm.world_size - S
    history = []
    for epoch in range(epochs):
        compute_s = comm_s = 0.0
        lags = []
        recv0 = tr.bytes_received
        for i, batch in enumerate(batches(train_ds.n_samples, global_batch, seed, epoch)):
            t0 = time.perf_counter()
            versions = client.pull()
            t1 = time.perf_counter()
            lo, hi = worker_slice(batch.numel(), q, W)
            g = batch_gradient(model, train_ds, batch[lo:hi], client.w)
            straggle(straggler_ms, seed, epoch, i, q, W)
            t2 = time.perf_counter()
            client.push(g, hi - lo)
            t3 = time.perf_counter()
            lags.append(client.clock - 1 - min(versions))
            compute_s += t2 - t1
            comm_s += (t1 - t0) + (t3 - t2)
        t0 = time.perf_counter()
        client.pull(required=client.clock)  # PostEpoch: every step of the epoch applied
        comm_s += time.perf_counter() - t0
        tr_m, te_m = _metrics(model, train_ds, client.w), _metrics(model, test_ds, client.w)
        rec = {"epoch": epoch + 1, "loss": tr_m[0], "train_acc": tr_m[1], "test_acc": te_m[1] if te_m else None,
               "compute_s": compute_s, "comm_s": comm_s, "bytes_received": tr.bytes_received - recv0,
               "rounds": None, "auto_picked": {}, "lag_max": max(lags, default=0),
               "lag_mean": sum(lags) / max(1, len(lags))}
        history.append(rec)
        if log is not None and q == 0:
            log(rec)
    client.finish()
    return {"w": client.w, "history": history}
