"""Collective calls of :class:`~sparsync.comm.Comm` (a mixin: the methods use the base class's backend
primitives and its ledger) and the cost each records, the same on every backend.

Cost (alpha-beta model, :mod:`sparsync.comm.ledger`), ``P`` ranks, ``m`` the (padded, i.e. actually
transferred) per-rank size in bytes:

* ``allgather``/``allgatherv`` (ring, as gloo does it): P-1 rounds, P-1 messages, (P-1)*m bytes
  each way; ``allgather_direct`` records the same (one batch of direct messages instead).
* ``allreduce`` (ring reduce-scatter + all-gather): 2(P-1) rounds and messages, 2(P-1)*m/P bytes
  each way.
* ``alltoallv`` (direct sends): P-1 rounds and messages, bytes = the non-self parts.
* ``broadcast`` (binomial tree): ceil(log2 P) rounds; the root sends m to each of P-1 ranks in the
  model's sense, every other rank receives m once.
* ``sparse_allreduce_coo``: two variable all-gathers (indices, then values).

Counts exchanged before a variable-size call are header traffic; control gathers
(:meth:`Collectives.allgather_control`, :meth:`Collectives.check_same`) record nothing.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .ledger import PhaseCost
from .messages import CommError, as_1d, gather_padded, nbytes

__all__ = ["Collectives"]


class Collectives:
    """All-gathers, all-reduces, all-to-all, broadcast and the backend's sparse all-reduce."""

    def _ring_cost(self, rounds_mult: int, nbytes_each_way: int) -> PhaseCost:
        P = self.world_size
        msgs = rounds_mult * (P - 1)
        return PhaseCost(msgs, msgs, nbytes_each_way, nbytes_each_way, msgs)

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """All ranks' tensors (same numel and dtype everywhere), in rank order."""
        t = as_1d(t, "allgather")
        out = self._allgather(t)
        sizes = {x.numel() for x in out}
        if len(sizes) != 1:
            raise CommError(f"allgather needs equal sizes on every rank, got {sorted(sizes)}; use allgatherv")
        cost = self._ring_cost(1, (self.world_size - 1) * nbytes(t))
        self._record(cost)
        self._charge_collective(cost)
        return out

    def allgather_into(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`allgather` into one flat tensor: rank ``r``'s ``t`` lands in
        ``out[r*m:(r+1)*m]`` (``m = t.numel()``, the same on every rank). No per-rank output tensors
        and no concatenation copy (dense all-gathers of large vectors). Same ledger as allgather."""
        t = self._gather_into_args(t, out, "allgather_into")
        self._allgather_into(t, out)
        self._charge_gather_into(t)
        return out

    def allgather_into_async(self, t: torch.Tensor, out: torch.Tensor) -> torch.futures.Future:
        """:meth:`allgather_into` posted without waiting: a ``torch.futures.Future`` whose value is ``out``,
        the same bits and the same ledger (recorded now). ``t`` and ``out`` stay untouched by the caller
        until it completes. Backends without asynchronous collectives gather now (a completed future)."""
        t = self._gather_into_args(t, out, "allgather_into_async")
        fut = self._allgather_into_async(t, out)
        self._charge_gather_into(t)
        return fut

    def _gather_into_args(self, t: torch.Tensor, out: torch.Tensor, name: str) -> torch.Tensor:
        """``t`` as 1-D, or a CommError when ``out`` is not its 1-D all-gather buffer."""
        t = as_1d(t, name)
        if out.dim() != 1 or out.numel() != self.world_size * t.numel() or out.dtype != t.dtype:
            raise CommError(f"{name} needs a 1-D {t.dtype} output of {self.world_size} x {t.numel()} "
                            f"elements, got {out.dtype} of shape {tuple(out.shape)}")
        return t

    def _charge_gather_into(self, t: torch.Tensor) -> None:
        cost = self._ring_cost(1, (self.world_size - 1) * nbytes(t))
        self._record(cost)
        self._charge_collective(cost)

    def _allgather_into_async(self, t: torch.Tensor, out: torch.Tensor) -> torch.futures.Future:
        """Post the gather of :meth:`allgather_into_async`; here: gather now, a completed future."""
        self._allgather_into(t, out)
        fut = torch.futures.Future()
        fut.set_result(out)
        return fut

    def allgather_direct(self, t: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`allgather` of a tensor whose size every rank knows to be the same everywhere, by
        one batch of direct sends and receives (:meth:`_allgather_direct`) instead of a ring: the
        same ledger as :meth:`allgather` (``P - 1`` rounds, messages and ``(P - 1) * nbytes`` each
        way) and the same result; no size check (a rank with another size is a protocol error of
        the caller). For small, latency-bound gathers (histograms, counts): one batch of messages
        instead of ``P - 1`` dependent ring steps (larger messages are slower direct, see
        ``torchcomm.DIRECT_GATHER_MAX``; ``sparsync bench gather-routes`` measures both)."""
        t = as_1d(t, "allgather_direct")
        out = self._allgather_direct(t)  # a virtual clock is charged per message by _post
        self._record(self._ring_cost(1, (self.world_size - 1) * nbytes(t)))
        return out

    def allgatherv(self, t: torch.Tensor, counts: list[int] | None = None) -> list[torch.Tensor]:
        """All ranks' tensors of possibly different lengths (counts first, then padded all-gather).

        ``counts``: every rank's length when the caller knows them already (the same list on every
        rank): no count round. The ledger records the padded size, which is what actually travels.
        """
        t = as_1d(t, "allgatherv")
        counts = self.gather_counts(t.numel()) if counts is None else [int(c) for c in counts]
        out = gather_padded(t, counts, self._allgather_equal)
        self._record_padded_gather(max(counts), t.element_size())
        return out

    def allgatherv_flat(self, t: torch.Tensor, counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """:meth:`allgatherv` into one flat tensor: ``(flat, counts)`` with rank ``r``'s tensor at
        ``flat[r*m : r*m + counts[r]]``, ``m = max(counts)`` (the rest of each slot is padding).
        No per-rank output tensors (gloo's list all-gather copies every rank's piece out of its
        flat buffer); the same ledger as :meth:`allgatherv`."""
        t = as_1d(t, "allgatherv_flat")
        counts = self.gather_counts(t.numel()) if counts is None else [int(c) for c in counts]
        m = max(counts)
        padded = t if t.numel() == m else torch.cat([t, t.new_zeros(m - t.numel())])
        flat = torch.empty(self.world_size * m, dtype=t.dtype, device=self.device)
        if m:
            self._allgather_equal_into(padded, flat)
        self._record_padded_gather(m, t.element_size())
        return flat, counts

    def gather_counts(self, count: int) -> list[int]:
        """Every rank's ``count`` in rank order: one small unrecorded gather (direct messages where
        the backend sends them so), recorded as ``P - 1`` 8-byte headers - the count half of a
        variable-size all-gather."""
        with self.unrecorded():
            got = self._allgather_equal(torch.tensor([int(count)], dtype=torch.int64, device=self.device))
        if self._recording:
            P = self.world_size
            self.ledger.record(PhaseCost(header_messages=P - 1, header_bytes=8 * (P - 1)))
        return [int(c[0]) for c in got]

    def _record_padded_gather(self, m: int, itemsize: int) -> None:
        if m:
            cost = self._ring_cost(1, (self.world_size - 1) * m * itemsize)
            self._record(cost)
            self._charge_collective(cost)

    def allreduce(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None,
                  pieces: bool = False) -> torch.Tensor:
        """Dense all-reduce (``sum``, ``max`` or ``min``); input untouched unless it is ``out``.

        The result goes into ``out`` when given (a buffer of ``t``'s size and dtype, or ``t`` itself
        for an in-place reduction: no copy at all), else into a new tensor. A caller that recycles
        ``out`` avoids the allocation (page faults of a fresh 40 MB buffer cost more than the copy).
        ``pieces`` (in place only): the backend may reduce ``t`` as several all-reduces in flight at
        once (:meth:`_allreduce_pieces_`; the same bytes, and the same bits on every rank).
        """
        t, out = self._allreduce_args(t, op, out)
        self._allreduce_now(t, out, op, pieces)
        self._record_allreduce(t)
        return out

    def allreduce_async(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None,
                        pieces: bool = False) -> torch.futures.Future:
        """:meth:`allreduce` posted without waiting: a ``torch.futures.Future`` whose value is the
        result tensor (``out``), with the same bits as :meth:`allreduce` of the same arguments (the
        same pieces) and the same ledger, recorded now. A failed collective sets the future's error.
        ``t`` and ``out`` must stay untouched until it completes. Backends without asynchronous
        collectives (:class:`~sparsync.threadcomm.ThreadComm`) reduce now and return a completed
        future."""
        t, out = self._allreduce_args(t, op, out)
        fut = self._allreduce_async(t, out, op, pieces)
        self._record_allreduce(t)
        return fut

    def _allreduce_async(self, t: torch.Tensor, out: torch.Tensor, op: str, pieces: bool) -> torch.futures.Future:
        """Post the all-reduce of :meth:`allreduce_async`; here: reduce now, a completed future."""
        self._allreduce_now(t, out, op, pieces)
        fut = torch.futures.Future()
        fut.set_result(out)
        return fut

    def _allreduce_now(self, t: torch.Tensor, out: torch.Tensor, op: str, pieces: bool) -> None:
        if out is t:
            (self._allreduce_pieces_ if pieces else self._allreduce_)(out, op)
        else:
            self._allreduce_into(t, out, op)

    def _allreduce_args(self, t: torch.Tensor, op: str, out: torch.Tensor | None):
        """(t, out) of an all-reduce, checked; a new output tensor when ``out`` is None."""
        if op not in ("sum", "max", "min"):
            raise CommError(f"allreduce op must be sum, max or min, got {op!r}")
        t = as_1d(t, "allreduce")
        if out is None:
            out = torch.empty_like(t, memory_format=torch.contiguous_format)
        elif out is not t and (out.shape != t.shape or out.dtype != t.dtype or not out.is_contiguous()):
            raise CommError(f"allreduce out must be a contiguous {t.dtype} tensor of shape {tuple(t.shape)}, "
                            f"got {out.dtype} {tuple(out.shape)}")
        return t, out

    def _record_allreduce(self, t: torch.Tensor) -> None:
        P = self.world_size
        cost = self._ring_cost(2, 2 * (P - 1) * nbytes(t) // P if P > 1 else 0)
        self._record(cost)
        self._charge_collective(cost)

    def alltoallv(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``parts[j]`` to rank j; returns the part every rank sent to this one (rank order)."""
        P = self.world_size
        if len(parts) != P:
            raise CommError(f"alltoallv needs one part per rank ({P}), got {len(parts)}")
        parts = [as_1d(p, "alltoallv") for p in parts]
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise CommError(f"alltoallv parts must share a dtype, got {dtypes}")
        send_splits = [p.numel() for p in parts]
        with self.unrecorded():
            recv_splits = self._alltoall(
                torch.tensor(send_splits, dtype=torch.int64, device=self.device), [1] * P, [1] * P
            ).tolist()
        flat = torch.cat(parts) if parts else torch.empty(0)
        out = self._alltoall(flat, send_splits, recv_splits)
        es = flat.element_size()
        cost = PhaseCost(
            messages_sent=P - 1,
            messages_received=P - 1,
            bytes_sent=es * (sum(send_splits) - send_splits[self.rank]),
            bytes_received=es * (sum(recv_splits) - recv_splits[self.rank]),
            rounds=P - 1,
            header_messages=P - 1,
            header_bytes=8 * (P - 1),
        )
        self._record(cost)
        self._charge_collective(cost)
        return list(torch.split(out, recv_splits))

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s tensor on every rank (all ranks pass a tensor of the same numel and dtype)."""
        t = as_1d(t, "broadcast")
        out = self._broadcast(t, src)
        P = self.world_size
        nb = nbytes(t)
        r = math.ceil(math.log2(P)) if P > 1 else 0
        if self.rank == src:
            cost = PhaseCost(messages_sent=P - 1, bytes_sent=(P - 1) * nb, rounds=r)
        else:
            cost = PhaseCost(messages_received=1, bytes_received=nb, rounds=r)
        self._record(cost)
        self._charge_collective(cost)
        return out

    def sparse_allreduce_coo(self, indices: torch.Tensor, values: torch.Tensor,
                             numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of every rank's COO vector ``(indices, values)`` by the backend's own sparse all-reduce
        (gloo's for TorchComm: all-gather of both tensors, then a coalescing sum).

        Returns (sorted unique int64 indices, summed values). Ledger: two variable all-gathers
        (int64 indices, then values) in the ring model, padded to the largest count ``m``:
        ``rounds = 2(P-1)``, ``bytes = (P-1) * m * (8 + isize)`` each way, plus the count exchange
        as header traffic. The counts come from one small unrecorded all-gather (torch's coalesced
        result does not reveal them), which is part of the call's time.
        """
        indices = as_1d(indices, "sparse_allreduce_coo").to(torch.int64)
        values = as_1d(values, "sparse_allreduce_coo")
        if indices.numel() != values.numel():
            raise CommError(f"sparse_allreduce_coo: {indices.numel()} indices but {values.numel()} values")
        P = self.world_size
        counts = self.allgather_control(torch.tensor([indices.numel()], dtype=torch.int64, device=self.device))
        m = max(int(c[0]) for c in counts)
        out = self._sparse_allreduce(indices, values, int(numel))
        nb = (P - 1) * m * (8 + values.element_size())
        cost = PhaseCost(2 * (P - 1), 2 * (P - 1), nb, nb, 2 * (P - 1), P - 1, 8 * (P - 1))
        self._record(cost)
        self._charge_collective(cost)
        return out

    def barrier(self) -> None:
        self._barrier()

    def allgather_control(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's small control tensor (counts, set-up checks; the same size on every rank),
        in rank order, as control traffic: nothing enters the ledger and no transfer time is
        charged to a virtual clock - it validates a call, it is not the payload."""
        with self.unrecorded():
            return self._allgather(t)

    def check_same(self, value: int, what: str) -> None:
        """Raise on every rank if ``value`` differs across ranks (unrecorded control traffic)."""
        vals = self.allgather_control(torch.tensor([int(value)], dtype=torch.int64, device=self.device))
        vals = [int(v[0]) for v in vals]
        if len(set(vals)) > 1:
            raise ValueError(f"{what} differs across ranks: " + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(vals)))
