"""One server's shard under bounded staleness: the state machine of the asynchronous parameter server,
without any communication (so every interleaving of pushes and pulls can be tested directly).

Model: the Stale Synchronous Parallel rule (Ho et al., NIPS 2013) applied to the SparCML thesis'
"ParameterServer asynchronous" strategy (Renggli's SparCML thesis, §2.1 and §4.2.2). Workers
``0..W-1`` each push one sparse gradient per step ``t = 0, 1, ...`` (their *clock* is the number of
pushes so far). The server keeps the model shard ``w`` and its **version** ``v`` = the number of steps
applied. Step ``t`` is applied once every worker still running at ``t`` pushed it:

    w <- w * (1 - lr*l2)                                   (only when l2 != 0)
    w <- w + (-(lr/b_t) * (g_0,t + g_1,t + ... ))          summed in worker order (``sparse.add``)

where ``b_t`` is the step's global batch (the sum of the pushed sample counts). Steps are applied in
order, so ``v = min over running workers of their clock``, i.e. the clock of the slowest worker.

**Staleness bound** ``s``: a worker about to compute step ``c`` may read the model only once
``v >= c - s`` (its pull waits otherwise); it then reads the shard at the server's current version
``v`` in ``[c - s, c]``. Hence every push of step ``c`` was computed on a model that has every step
``< c - s`` of every worker applied, and the server's version when the push arrives is ``>= c - s``;
both are recorded per push (:attr:`ShardState.log`) and checked. With ``s = 0`` the read version is
exactly ``c``: every worker computes step ``c`` on ``w_c``, which is the synchronous parameter
server's trajectory. The per-step sum in worker order and the update formula above are the same
operations :func:`sparsync.ps.sync.ps_allreduce` and :func:`apply_update` (the trainer's step) do, so
``s = 0`` is *bitwise* the synchronous PS (tested).

A worker that **finishes early** (``finish``) stops counting from its final clock on: later steps are
applied without it, so the others never wait for it (no hang). Pulls return only the coordinates that
changed since the version the worker holds (``changed`` records, per coordinate, the version that last
wrote it): the model, exactly, at the cost of the union of the updates it missed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sparse import SparseVec, add, add_at, sparse_is_smaller

__all__ = ["PushRecord", "ShardState", "StalenessViolation", "apply_update", "check_staleness"]


def apply_update(w: torch.Tensor, total, scale: float) -> None:
    """``w <- w + (-(scale * total))``, one rounding for the product and one for the sum, whether
    ``total`` is a SparseVec or dense: the same bits for the same update in either representation
    (a fused ``add_(alpha=...)`` may round once or twice depending on the vector lane). The SGD step
    of :func:`sparsync.linear.sgd.train` and of the parameter-server shard."""
    if isinstance(total, SparseVec):
        add_at(w, total.indices, total.values * (-scale))
    else:
        w.add_(total * (-scale))


class StalenessViolation(RuntimeError):
    """A push or pull broke the staleness bound or the per-worker step order (a protocol bug)."""


def check_staleness(staleness) -> int:
    if isinstance(staleness, bool) or int(staleness) != staleness or int(staleness) < 0:
        raise ValueError(f"parameter server: staleness must be an integer >= 0, got {staleness!r}")
    return int(staleness)


@dataclass(frozen=True)
class PushRecord:
    """One applied push: ``step - read_version <= s`` and ``step - server_version <= s`` must hold."""

    worker: int
    step: int
    read_version: int    # version of this shard the worker computed the gradient on
    server_version: int  # this shard's version when the push arrived


class ShardState:
    """Model shard of width ``width`` served to ``workers`` workers with staleness ``staleness``."""

    def __init__(self, width: int, workers: int, staleness: int, lr: float, l2: float = 0.0,
                 dtype=torch.float32):
        self.w = torch.zeros(int(width), dtype=dtype)
        self.changed = torch.zeros(int(width), dtype=torch.int64)  # version that last wrote each coordinate
        self.workers, self.s = int(workers), check_staleness(staleness)
        self.lr, self.l2 = float(lr), float(l2)
        self.version = 0
        self.clock = [0] * self.workers            # pushes received per worker
        self.final: list[int | None] = [None] * self.workers  # clock at finish
        self.pending: dict[int, dict[int, tuple]] = {}        # step -> {worker: (payload, count)}
        self.log: list[PushRecord] = []

    # ------------------------------------------------------------------ events
    def push(self, worker: int, step: int, read_version: int, count: int, payload) -> None:
        """Worker ``worker``'s gradient of ``step`` (the sum over its ``count`` samples), computed on
        this shard at ``read_version``. Applies every step that became complete."""
        if self.final[worker] is not None:
            raise StalenessViolation(f"worker {worker} pushed step {step} after finishing at {self.final[worker]}")
        if step != self.clock[worker]:
            raise StalenessViolation(f"worker {worker} pushed step {step}, expected step {self.clock[worker]}")
        if step - read_version > self.s or step - self.version > self.s or read_version > step:
            raise StalenessViolation(
                f"worker {worker} pushed step {step} computed on version {read_version} (server at "
                f"{self.version}), staleness bound {self.s}")
        self.log.append(PushRecord(worker, step, read_version, self.version))
        self.pending.setdefault(step, {})[worker] = (payload, int(count))
        self.clock[worker] += 1
        self._advance()

    def finish(self, worker: int) -> None:
        """Worker ``worker`` pushes no more steps; steps from its clock on are applied without it."""
        self.final[worker] = self.clock[worker]
        self._advance()

    def ready(self, required: int) -> bool:
        """May a pull that needs version ``required`` be answered now?"""
        return self.version >= required

    @property
    def done(self) -> bool:
        """Every worker finished and every pushed step is applied."""
        return all(f is not None for f in self.final) and not self.pending

    def delta(self, since: int):
        """The shard's coordinates written after version ``since``, with their current values: a
        SparseVec over the shard, or the dense shard when the sparse form is not smaller."""
        idx = torch.nonzero(self.changed > since).flatten()
        if not sparse_is_smaller(idx.numel(), self.w.numel(), self.w.dtype):
            return self.w.clone()
        return SparseVec(idx, self.w[idx], self.w.numel(), check=False)

    # ------------------------------------------------------------------ applying steps
    def _running(self, t: int) -> list[int]:
        return [q for q in range(self.workers) if self.final[q] is None or self.final[q] > t]

    def _advance(self) -> None:
        t = self.version
        while t in self.pending and all(q in self.pending[t] for q in self._running(t)):
            got = self.pending.pop(t)
            parts = [got[q] for q in sorted(got)]  # worker order: the synchronous server's rank order
            total = parts[0][0]
            for p, _ in parts[1:]:
                total = add(total, p)
            b = sum(c for _, c in parts)
            self._apply(total, b)
            t = self.version

    def _apply(self, total, b: int) -> None:
        self.version += 1
        if self.l2:
            self.w.mul_(1.0 - self.lr * self.l2)
        apply_update(self.w, total, self.lr / b)
        if self.l2 or not isinstance(total, SparseVec):
            self.changed.fill_(self.version)
        else:
            self.changed[total.indices] = self.version
