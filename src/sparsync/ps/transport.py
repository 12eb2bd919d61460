"""Point-to-point messages for the asynchronous parameter server: ``torch.distributed`` isend/irecv
(gloo) with tags, receives from *any* worker, and a timeout on every receive.

The :class:`~sparsync.comm.Comm` interface is bulk-synchronous (matched sends and receives, no
any-source receive), which is exactly what an asynchronous server must not be: it serves whichever
worker's message arrives first. So this module talks to ``torch.distributed`` directly, on the
group's ranks, and keeps its own byte counts (``bytes_sent`` / ``bytes_received``, payload and
headers). Every receive waits at most ``timeout`` seconds and then raises :class:`PSTimeout` with a
description of what it waited for (peer, step) — never a hang. A timed-out gloo receive closes the
pair, so the error is final for the run (the launcher then reports it and ends every rank).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["GlooTransport", "PSTimeout", "TAG_BASE"]

TAG_BASE = 7100  # p2p tags of this protocol: far from the Comm's tag 0, so the two never match


class PSTimeout(TimeoutError):
    """A parameter-server receive waited longer than the timeout; the message names peer and step."""


class GlooTransport:
    """Tagged isend/irecv on ``group`` (None: the default group), with timeouts and byte counts."""

    def __init__(self, group=None, timeout: float = 60.0):
        if not dist.is_initialized():
            raise RuntimeError("the asynchronous parameter server needs torch.distributed (backend gloo)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = float(timeout)
        self._sends: list[tuple] = []  # (work, tensor): tensors stay alive until their send completed
        self.bytes_sent = 0
        self.bytes_received = 0

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _wait(self, work, what: str, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            if "imed out" not in str(e):
                raise
            raise PSTimeout(f"rank {self.rank}: {what}: no message after {timeout:g} s "
                            "(peer stopped, crashed or is stuck)") from None

    def isend(self, dst: int, t: torch.Tensor, tag: int) -> None:
        """Non-blocking send; completion is checked by :meth:`flush` (and pruned as sends finish)."""
        t = t.contiguous()
        self._sends = [(w, x) for w, x in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(t, self._peer(dst), group=self.group, tag=TAG_BASE + tag), t))
        self.bytes_sent += t.numel() * t.element_size()

    def recv(self, src: int, numel: int, dtype, tag: int, what: str, timeout: float | None = None) -> torch.Tensor:
        """Receive ``numel`` items from ``src``; ``timeout`` (default: the transport's) in seconds."""
        buf = torch.empty(int(numel), dtype=dtype)
        if numel:
            self._wait(dist.irecv(buf, self._peer(src), group=self.group, tag=TAG_BASE + tag), what, timeout)
            self.bytes_received += buf.numel() * buf.element_size()
        return buf

    def recv_any(self, numel: int, dtype, tag: int, what: str) -> tuple[int, torch.Tensor]:
        """The next message with ``tag`` from any rank: ``(source rank, tensor)``."""
        buf = torch.empty(int(numel), dtype=dtype)
        work = dist.irecv(buf, None, group=self.group, tag=TAG_BASE + tag)
        self._wait(work, what)
        self.bytes_received += buf.numel() * buf.element_size()
        return work._source_rank(), buf  # gloo reports the rank within the group

    def flush(self, what: str) -> None:
        """Wait for every posted send (each with the timeout)."""
        for w, _ in self._sends:
            self._wait(w, what)
        self._sends.clear()
