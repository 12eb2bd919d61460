"""ThreadComm: P ranks as threads of one process, with a virtual alpha-beta clock.

For fast exhaustive tests (any world size up to ``MAX_THREAD_RANKS`` = 256) and for *executed simulation*: the same
algorithm code runs, and each rank's virtual clock advances by ``alpha + beta*bytes`` per message
it sends; a receive waits until the message's arrival time (the alpha-beta cost model).
Collectives advance every rank to ``max(clock) + rounds*alpha + beta*bytes_received`` of the ring
model recorded in the ledger (see :mod:`sparsync.comm`).

Point-to-point messages travel through one FIFO queue per (src, dst) pair; collectives meet in a
shared slot per call sequence number, where the last rank to arrive computes the result once
(in rank order, so every rank gets bitwise identical sums). A rank that raises sets the world's
abort flag and every waiting rank fails within ``poll`` seconds instead of hanging.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

from .comm import Comm, CommError, Handle, PhaseCost
from .sparse import add_at

__all__ = ["MAX_THREAD_RANKS", "ThreadWorld", "ThreadComm", "RankAborted", "check_thread_world_size"]

#: Largest world of the thread cluster (``ThreadWorld`` and ``run_local(backend="thread")`` alike).
#: Every rank is one OS thread of this process and every (src, dst) pair gets its own queue (P^2 of
#: them), all under one GIL; 256 is the largest P the executed simulation and the tests use
#: (``sparsync simulate collectives --max-exec-p``). A cap chosen for that, not a measured limit:
#: beyond it runs get slow, not wrong; larger P is covered by the alpha-beta formulas (up to 4096).
MAX_THREAD_RANKS = 256


def check_thread_world_size(world_size) -> int:
    """``world_size`` as an int in ``1..MAX_THREAD_RANKS``; ValueError naming the problem otherwise."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not 1 <= world_size <= MAX_THREAD_RANKS:
        raise ValueError(f"world_size must be in 1..{MAX_THREAD_RANKS} for the thread cluster "
                         f"(MAX_THREAD_RANKS: one thread per rank), got {world_size}")
    return world_size


class RankAborted(RuntimeError):
    """Raised in a rank whose peers failed (the original error is reported by run_local)."""


class ThreadWorld:
    """Shared state of one thread cluster."""

    def __init__(self, world_size: int, alpha: float = 0.0, beta: float = 0.0, timeout: float = 60.0):
        self.world_size = check_thread_world_size(world_size)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.timeout = float(timeout)
        self.poll = 0.02  # s between abort checks of a waiting rank: fails fast, ~50 idle wake-ups/s
        self._channels: dict[tuple[int, int], queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._slots: dict[int, dict] = {}
        self.aborted = threading.Event()
        self.abort_reason = ""

    def channel(self, src: int, dst: int) -> queue.SimpleQueue:
        key = (src, dst)
        ch = self._channels.get(key)
        if ch is None:
            with self._lock:
                ch = self._channels.setdefault(key, queue.SimpleQueue())
        return ch

    def abort(self, reason: str) -> None:
        self.abort_reason = reason
        self.aborted.set()
        with self._cond:
            self._cond.notify_all()

    def subworld(self, key) -> "ThreadWorld":
        """The world of one sub-group (``key``: any hashable naming the split and the group; the
        same object for every rank that asks). It shares this world's abort flag."""
        with self._lock:
            subs = self.__dict__.setdefault("_subworlds", {})
            w = subs.get(key)
            if w is None:
                w = subs[key] = ThreadWorld(len(key[1]), self.alpha, self.beta, self.timeout)
                w.aborted = self.aborted
                w._parent = self
            return w

    def comms(self) -> list["ThreadComm"]:
        return [ThreadComm(self, r) for r in range(self.world_size)]


class ThreadComm(Comm):
    """One rank of a :class:`ThreadWorld`."""

    def __init__(self, world: ThreadWorld, rank: int, device: str = "cpu"):
        super().__init__(rank, world.world_size, device)
        self.world = world
        self._seq = 0
        self._clock = 0.0

    # ------------------------------------------------------------------ clock
    @property
    def clock(self) -> float:
        return self._clock

    def modelled_link(self) -> tuple[float, float]:
        return self.world.alpha, self.world.beta

    def advance(self, seconds: float) -> None:
        """Charge local work (e.g. modelled compute) to this rank's virtual clock."""
        self._clock += float(seconds)

    def _charge_collective(self, cost: PhaseCost) -> None:
        # _collective already moved the clock to max over ranks; add the modelled transfer time.
        self._clock += cost.rounds * self.world.alpha + self.world.beta * cost.bytes_received

    # ------------------------------------------------------------------ waiting
    def _check_abort(self) -> None:
        if self.world.aborted.is_set():
            w = self.world
            while not w.abort_reason and getattr(w, "_parent", None) is not None:  # a sub-group's world
                w = w._parent
            raise RankAborted(f"rank {self.rank}: another rank failed ({w.abort_reason})")

    def _split(self, groups):
        g = next(g for g in groups if self.rank in g)
        return ThreadComm(self.world.subworld((groups, g)), g.index(self.rank), device=str(self.device))

    def _get(self, ch: queue.SimpleQueue, what: str):
        deadline = time.monotonic() + self.world.timeout
        while True:
            self._check_abort()
            try:
                return ch.get(timeout=self.world.poll)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank {self.rank}: {what} timed out after {self.world.timeout:.0f}s "
                        "(a peer never sent; mismatched communication calls?)"
                    ) from None

    # ------------------------------------------------------------------ primitives
    def _post(self, sends, recvs) -> list[Handle]:
        w = self.world
        for dst, t in sends:
            self._clock += w.alpha + w.beta * t.numel() * t.element_size()
            w.channel(self.rank, dst).put((t.clone(), self._clock))
        handles = []
        for src, n, dt in recvs:
            ch = w.channel(src, self.rank)

            def waiter(ch=ch, src=src, n=n, dt=dt):
                t, arrival = self._get(ch, f"receive from rank {src}")
                if t.numel() != n or t.dtype != dt:
                    raise CommError(
                        f"rank {self.rank}: expected {n} x {dt} from rank {src}, got {t.numel()} x {t.dtype} "
                        "(mismatched send/recv sizes or header protocol)"
                    )
                self._clock = max(self._clock, arrival)
                return t

            handles.append(Handle(waiter))
        return handles

    def _collective(self, kind: str, value, combine: Callable[[list], object]):
        """Meet all ranks in the slot for this call; the last to arrive computes ``combine`` once."""
        w = self.world
        seq = self._seq
        self._seq += 1
        deadline = time.monotonic() + w.timeout
        with w._cond:
            slot = w._slots.get(seq)
            if slot is None:
                slot = w._slots[seq] = {"kind": kind, "vals": [None] * w.world_size, "clocks": [0.0] * w.world_size,
                                        "n": 0, "done": False, "result": None, "error": None,
                                        "left": w.world_size}
            if slot["kind"] != kind:
                slot["error"] = CommError(
                    f"collective mismatch at call #{seq}: rank {self.rank} called {kind}, others {slot['kind']}")
            slot["vals"][self.rank] = value
            slot["clocks"][self.rank] = self._clock
            slot["n"] += 1
            if slot["n"] == w.world_size:
                if slot["error"] is None:
                    try:
                        slot["result"] = combine(slot["vals"])
                    except Exception as e:  # surfaced on every rank
                        slot["error"] = e
                slot["done"] = True
                w._cond.notify_all()
            while not slot["done"]:
                if w.aborted.is_set():
                    break
                if time.monotonic() > deadline:
                    w._cond.release()
                    try:
                        raise TimeoutError(
                            f"rank {self.rank}: {kind} (call #{seq}) timed out after {w.timeout:.0f}s; "
                            f"{slot['n']} of {w.world_size} ranks arrived"
                        )
                    finally:
                        w._cond.acquire()
                w._cond.wait(w.poll)
            self._check_abort()
            slot["left"] -= 1
            if slot["left"] == 0:
                del w._slots[seq]
            if slot["error"] is not None:
                raise slot["error"]
            start = max(slot["clocks"])
            result = slot["result"]
        self._clock = start
        return result

    def _allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        vals = self._collective("allgather", t.clone(), lambda v: v)
        return [v.clone() for v in vals]

    def _allgather_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        torch.cat(self._allgather(t), out=out)

    def _allreduce_(self, t: torch.Tensor, op: str) -> None:
        def combine(vals):
            out = vals[0].clone()
            for v in vals[1:]:  # canonical rank order: identical result on every rank
                if v.shape != out.shape or v.dtype != out.dtype:
                    raise CommError(f"allreduce shape/dtype mismatch: {tuple(v.shape)} {v.dtype} vs "
                                    f"{tuple(out.shape)} {out.dtype}")
                if op == "sum":
                    out += v
                elif op == "max":
                    torch.maximum(out, v, out=out)
                else:
                    torch.minimum(out, v, out=out)
            return out

        t.copy_(self._collective("allreduce:" + op, t.clone(), combine))

    def _alltoall(self, flat, send_splits, recv_splits) -> torch.Tensor:
        P = self.world_size
        parts = list(torch.split(flat.clone(), send_splits))
        matrix = self._collective("alltoall", parts, lambda v: v)
        mine = [matrix[src][self.rank] for src in range(P)]
        got = [m.numel() for m in mine]
        if got != list(recv_splits):
            raise CommError(f"alltoall: expected splits {list(recv_splits)}, peers sent {got}")
        return torch.cat(mine).clone() if mine else flat.new_empty(0)

    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        vals = self._collective("broadcast", t.clone() if self.rank == src else None, lambda v: v)
        return vals[src].clone()

    def _sparse_allreduce(self, indices, values, numel):
        """Gather both tensors, then coalesce in rank order (torch's sparse all-reduce semantics)."""
        idx = torch.cat(self._collective("sparse_allreduce:indices", indices.clone(), lambda v: v))
        vals = torch.cat(self._collective("sparse_allreduce:values", values.clone(), lambda v: v))
        uniq, inverse = torch.unique(idx, sorted=True, return_inverse=True)
        out = torch.zeros(uniq.numel(), dtype=vals.dtype, device=vals.device)
        return uniq, add_at(out, inverse, vals)

    def _barrier(self) -> None:
        self._collective("barrier", None, lambda v: None)

