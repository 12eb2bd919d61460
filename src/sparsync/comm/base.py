"""The base :class:`Comm`: what a backend implements, and the ledger every call records into.

A backend (:class:`sparsync.threadcomm.ThreadComm`, :class:`sparsync.torchcomm.TorchComm`) implements
the abstract primitives (``_post``, ``_allgather``, ``_allreduce_``, ...) and may override the
defaults here (``_allgather_direct``, ``_allreduce_into``, ...) where it has a faster route; the
public calls (:mod:`sparsync.comm.p2p`, :mod:`sparsync.comm.collective`) check their arguments and
record their cost here, in the base class, so both backends record identical ledgers.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from .collective import Collectives
from .ledger import Ledger, PhaseCost
from .messages import CommError, Handle
from .p2p import PointToPoint

__all__ = ["Comm"]


class Comm(PointToPoint, Collectives, ABC):
    """P ranks that can exchange 1-D tensors. Every call records its cost in ``self.ledger``."""

    rank: int
    world_size: int
    device: torch.device

    def __init__(self, rank: int, world_size: int, device: torch.device | str = "cpu"):
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.device = torch.device(device)
        self.ledger = Ledger()
        self._recording = True
    # ------------------------------------------------------------------ backend primitives
    @abstractmethod
    def _post(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, int, torch.dtype]],
    ) -> list[Handle]:
        """Post sends (dst, tensor) and fixed-size receives (src, numel, dtype) together.

        Returns one handle per receive, in order. Sends complete before or with the handles.
        Empty tensors are never passed here.
        """

    @abstractmethod
    def _allgather(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    def _allgather_equal(self, t: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`_allgather` of a tensor whose size is the same on every rank by construction (a
        count, a list padded to the largest count): no size check is needed, so a backend may send
        it by another route. Here: :meth:`_allgather`."""
        return self._allgather(t)

    def _allgather_equal_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """:meth:`_allgather_equal` into the flat ``out`` (``P * t.numel()``), in rank order."""
        torch.cat(self._allgather_equal(t), out=out)

    def _allgather_direct(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (the same size everywhere), in rank order, by one batch of ``P - 1``
        direct sends and receives of known size (:meth:`_post`): all messages in flight at once,
        where a ring all-gather makes ``P - 1`` dependent steps. Records nothing (callers do)."""
        P, me = self.world_size, self.rank
        if P == 1 or t.numel() == 0:
            return [t.clone() for _ in range(P)] if P > 1 else [t]
        peers = [(me + d) % P for d in range(1, P)]
        handles = self._post([(p, t) for p in peers], [(p, t.numel(), t.dtype) for p in peers])
        got = {p: h.wait() for p, h in zip(peers, handles)}
        got[me] = t
        return [got[p] for p in range(P)]

    @abstractmethod
    def _allreduce_(self, t: torch.Tensor, op: str) -> None:
        """Reduce ``t`` over ranks in place (the same bits on every rank)."""

    def _allreduce_pieces_(self, t: torch.Tensor, op: str) -> None:
        """:meth:`_allreduce_` as pieces in flight at once where the backend gains by it (TorchComm on
        CPU); here: one all-reduce."""
        self._allreduce_(t, op)

    def _allreduce_into(self, t: torch.Tensor, out: torch.Tensor, op: str) -> None:
        """Reduce ``t`` over ranks into ``out`` (same size, not aliasing ``t``); ``t`` untouched.
        Here: copy, then :meth:`_allreduce_` in place; a backend may overlap the two."""
        out.copy_(t)
        self._allreduce_(out, op)

    @abstractmethod
    def _allgather_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's ``t`` (equal sizes) into ``out`` (``P * t.numel()``), in rank order."""

    @abstractmethod
    def _alltoall(self, flat: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor: ...

    @abstractmethod
    def _broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _sparse_allreduce(self, indices: torch.Tensor, values: torch.Tensor,
                          numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The backend's own sparse COO all-reduce: every rank's (int64 indices, values) summed,
        returned coalesced (sorted unique indices, summed values), identical on every rank."""

    @abstractmethod
    def _barrier(self) -> None: ...

    def _charge_collective(self, cost: PhaseCost) -> None:
        """Hook for backends with a virtual clock (ThreadComm); called after a collective's cost is known."""
        return None

    # ------------------------------------------------------------------ accounting
    @contextlib.contextmanager
    def phase(self, label: str):
        """Record every call inside the block under ``label`` (phases nest; the inner label wins)."""
        prev = self.ledger.label
        self.ledger.label = label
        try:
            yield
        finally:
            self.ledger.label = prev

    @contextlib.contextmanager
    def unrecorded(self):
        """Calls inside the block are not recorded (input validation, calibration)."""
        prev = self._recording
        self._recording = False
        try:
            yield
        finally:
            self._recording = prev

    def _record(self, cost: PhaseCost) -> None:
        if self._recording:
            self.ledger.record(cost)

    # ------------------------------------------------------------------ sub-communicators
    def split(self, groups: Sequence[Sequence[int]]) -> "Comm":
        """The sub-communicator of the group in ``groups`` (a partition of this comm's ranks) that holds
        this rank; its ranks are numbered in the group's ascending order.

        Every rank calls it with the same partition, and ranks make their splits in the same order
        (on gloo, creating a group is a collective of the whole world). The result is cached per
        partition, so later calls (e.g. by several reducers) cost nothing and share it. What the
        sub-communicator sends is recorded in its own ledger *and* in this one's (under this one's
        current phase), so a caller measuring ``self.ledger`` sees its sub-groups' traffic. A
        ThreadComm sub-communicator keeps its own virtual clock.
        """
        key = tuple(sorted(tuple(sorted(int(r) for r in g)) for g in groups))
        if sorted(r for g in key for r in g) != list(range(self.world_size)) or any(not g for g in key):
            raise CommError(f"split needs a partition of ranks 0..{self.world_size - 1} into non-empty groups, "
                            f"got {[list(g) for g in groups]}")
        cache = self.__dict__.setdefault("_subcomms", {})
        sub = cache.get(key)
        if sub is None:
            sub = cache[key] = self._split(key)
            sub.ledger.parent = self.ledger
        return sub

    def _split(self, groups: tuple[tuple[int, ...], ...]) -> "Comm":
        """Backend part of :meth:`split` (``groups``: sorted tuples, a checked partition)."""
        raise CommError(f"{type(self).__name__} cannot make sub-communicators")

    @property
    def clock(self) -> float | None:
        """Virtual time in seconds (ThreadComm with alpha/beta set); None on real backends."""
        return None

    def modelled_link(self) -> tuple[float, float] | None:
        """``(alpha, beta)`` of the modelled network whose costs a virtual clock charges (ThreadComm; both
        0 when none was given); None on a real network, whose costs can only be measured."""
        return None
