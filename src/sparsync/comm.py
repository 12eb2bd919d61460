"""Comm: the only interface gradient-exchange algorithms talk to, and its cost ledger.

Algorithms call the public methods of :class:`Comm`; two backends implement a handful of
primitives underneath (:class:`sparsync.threadcomm.ThreadComm`: ranks as threads with a virtual
alpha-beta clock; :class:`sparsync.torchcomm.TorchComm`: a real ``torch.distributed`` group).
All accounting happens here, in the base class, so both backends record identical ledgers.

Cost accounting (the alpha-beta model ``x*alpha + y*beta``: ``x`` sequential message rounds, ``y``
bytes; Hockney, "The communication challenge for MPP", Parallel Computing 20, 1994):

* point-to-point batch (``send``, ``recv``, ``sendrecv``, ``exchange``, ``post``): one message per
  payload; ``rounds += max(#sends, #recvs)`` (every message posted pays one alpha at its sender, so a
  recursive-doubling step is 1 round and SparCML's direct sends to P-1 peers are P-1 rounds).
* ``allgather``/``allgatherv`` (ring, as gloo does it): P-1 rounds, P-1 messages, (P-1)*m bytes
  each way, where m is the (padded, i.e. actually transferred) per-rank size.
* ``allreduce`` (ring reduce-scatter + all-gather): 2(P-1) rounds and messages, 2(P-1)*m/P bytes
  each way.
* ``alltoallv`` (direct sends): P-1 rounds and messages, bytes = the non-self parts.
* ``broadcast`` (binomial tree): ceil(log2 P) rounds; the root sends m to each of P-1 ranks in the
  model's sense, every other rank receives m once.

Variable-size messages use a **size-header protocol**: the sender first sends one int64 element
count, then the payload (skipped when empty). We chose headers over fixed capacity because the
sparse algorithms' message sizes are data dependent and a capacity of ``numel`` would make every
message dense-sized. Algorithms that *know* the size (fixed-capacity blocks, SparDL) pass it to the
receive call and no header travels. Headers are recorded separately (``header_messages``,
``header_bytes``) and are not part of ``messages_sent``/``bytes_sent``/``rounds``, which follow the
documents' formulas; they travel in the same round as their payload.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Callable, Iterable, Sequence

import torch

__all__ = ["Comm", "Ledger", "PhaseCost", "Handle", "CommError"]


def gather_padded(t: torch.Tensor, counts: list[int], gather) -> list[torch.Tensor]:
    """Every rank's ``t`` (``counts[r]`` elements on rank ``r``), in rank order, by one fixed-size
    ``gather`` (tensor -> list in rank order) of ``t`` zero-padded to ``max(counts)``."""
    m = max(counts)
    if m == 0:
        return [t.new_empty(0) for _ in counts]
    padded = t if t.numel() == m else torch.cat([t, t.new_zeros(m - t.numel())])
    return [x[:c] for x, c in zip(gather(padded), counts)]


class CommError(RuntimeError):
    """A communication call was used wrongly (mismatched collectives, bad peer, bad sizes)."""


@dataclass
class PhaseCost:
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    header_messages: int = 0
    header_bytes: int = 0

    def add(self, other: "PhaseCost") -> None:
        for name in _COST_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        """The counters as a plain dict (``dataclasses.asdict`` without its deep copies: the ledger
        is read before and after every reduce, on the communication thread's critical path)."""
        return {name: getattr(self, name) for name in _COST_FIELDS}


_COST_FIELDS = tuple(f.name for f in fields(PhaseCost))


class Ledger:
    """Per-rank record of messages, sequential rounds and bytes, keyed by a phase label.

    The totals (``ledger.bytes_sent`` etc.) sum over phases; ``ledger.phases[label]`` holds one
    phase. Algorithms set the label with ``with comm.phase("reduce-scatter"): ...``.
    """

    def __init__(self, parent: "Ledger | None" = None) -> None:
        self.phases: dict[str, PhaseCost] = {}
        self.label = "default"
        self._total = PhaseCost()  # kept with every record: the totals are read around every reduce
        self.parent = parent  # a sub-communicator's ledger also records into its parent's (Comm.split)

    def record(self, cost: PhaseCost) -> None:
        self.phases.setdefault(self.label, PhaseCost()).add(cost)
        self._total.add(cost)
        if self.parent is not None:
            self.parent.record(cost)

    def total(self) -> PhaseCost:
        """The sum over phases (a copy)."""
        return PhaseCost(**self._total.as_dict())

    def __getattr__(self, name):  # totals: messages_sent, bytes_sent, bytes_received, rounds, ...
        if name in _COST_FIELDS:
            return getattr(self._total, name)
        raise AttributeError(name)

    def snapshot(self) -> dict:
        """Totals as a plain dict (cheap to compare before/after a call)."""
        return self._total.as_dict()

    def since(self, snap: dict) -> dict:
        now = self.snapshot()
        return {k: now[k] - snap.get(k, 0) for k in now}

    def reset(self) -> None:
        self.phases.clear()
        self._total = PhaseCost()

    def __repr__(self) -> str:
        return f"Ledger({self.snapshot()}, phases={list(self.phases)})"


class Handle:
    """A posted receive (or send); ``wait()`` returns the received tensor (or None for a send)."""

    def __init__(self, waiter: Callable[[], torch.Tensor | None]):
        self._waiter = waiter
        self._done = False
        self._value = None

    def wait(self):
        if not self._done:
            self._value = self._waiter()
            self._done = True
        return self._value


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_1d(t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{what}: messages are 1-D tensors, got shape {tuple(t.shape)}")
    return t.contiguous()


class Comm(ABC):
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

    def _check_peer(self, peer: int, what: str) -> int:
        peer = int(peer)
        if not 0 <= peer < self.world_size:
            raise CommError(f"{what}: peer {peer} is outside ranks 0..{self.world_size - 1}")
        if peer == self.rank:
            raise CommError(f"{what}: rank {self.rank} cannot message itself")
        return peer

    # ------------------------------------------------------------------ point to point
    def post(
        self,
        sends: Iterable[tuple[int, torch.Tensor]] = (),
        recvs: Iterable[tuple[int, int, torch.dtype]] = (),
        rounds: int | None = None,
    ) -> list[Handle]:
        """Non-blocking batch with known sizes: returns a handle per receive, in the order given.

        Use it to overlap work with in-flight receives (SparCML's split phase). Zero-length
        messages are skipped on both sides (the receiver knows the size, so it knows).
        """
        sends = [(self._check_peer(d, "post"), _as_1d(t, "post")) for d, t in sends]
        recvs = [(self._check_peer(s, "post"), int(n), dt) for s, n, dt in recvs]
        cost = PhaseCost(
            messages_sent=sum(1 for _, t in sends if t.numel()),
            messages_received=sum(1 for _, n, _ in recvs if n),
            bytes_sent=sum(_nbytes(t) for _, t in sends),
            bytes_received=sum(n * torch.empty(0, dtype=dt).element_size() for _, n, dt in recvs),
            rounds=max(len(sends), len(recvs)) if rounds is None else rounds,
        )
        self._record(cost)
        live_sends = [(d, t) for d, t in sends if t.numel()]
        live_recvs = [(s, n, dt) for s, n, dt in recvs if n]
        handles = self._post(live_sends, live_recvs) if (live_sends or live_recvs) else []
        it = iter(handles)
        out = []
        for _, n, dt in recvs:
            if n:
                out.append(next(it))
            else:
                out.append(Handle(lambda dt=dt: torch.empty(0, dtype=dt, device=self.device)))
        return out

    def exchange(
        self,
        sends: dict[int, torch.Tensor] | Iterable[tuple[int, torch.Tensor]] = (),
        recvs: dict[int, tuple[int, torch.dtype] | torch.dtype] | Iterable = (),
        rounds: int | None = None,
    ) -> dict[int, torch.Tensor]:
        """Blocking batch exchange with several peers at once; returns {src: tensor}.

        ``recvs`` maps src -> ``(numel, dtype)`` for known sizes (no header) or -> ``dtype`` for a
        variable size (the sender's side then must use a variable send too: every send to a peer
        whose receive is variable-size is preceded by a header). To keep both sides in agreement,
        ``sends`` values that are tuples ``(tensor, "fixed")`` skip the header; plain tensors send one.
        """
        sends = list(sends.items()) if isinstance(sends, dict) else list(sends)
        recvs = list(recvs.items()) if isinstance(recvs, dict) else list(recvs)
        var_sends = [(d, t) for d, t in sends if not isinstance(t, tuple)]
        fixed_sends = [(d, t[0]) for d, t in sends if isinstance(t, tuple)]
        var_recvs = [(s, spec) for s, spec in recvs if not isinstance(spec, tuple)]
        sizes = {s: spec[0] for s, spec in recvs if isinstance(spec, tuple)}
        dtypes = {s: (spec[1] if isinstance(spec, tuple) else spec) for s, spec in recvs}
        if var_sends or var_recvs:
            sizes.update(self.exchange_sizes(var_sends, [s for s, _ in var_recvs]))
        all_sends = fixed_sends + var_sends
        handles = self.post(all_sends, [(s, sizes[s], dtypes[s]) for s, _ in recvs], rounds=rounds)
        return {s: h.wait() for (s, _), h in zip(recvs, handles)}

    def exchange_sizes(self, sends, srcs) -> dict[int, int]:
        """Send the element count of each ``(dst, tensor)`` and receive one count from each of ``srcs``.

        The size-header half of the variable-size protocol, public for algorithms that post the
        payloads themselves (counts first, then :meth:`post` with known sizes to overlap work with
        in-flight receives). One int64 per message, recorded as header traffic.
        """
        hdr_sends = [(self._check_peer(d, "send"), torch.tensor([_as_1d(t, "send").numel()],
                      dtype=torch.int64, device=self.device)) for d, t in sends]
        hdr_recvs = [(self._check_peer(s, "recv"), 1, torch.int64) for s in srcs]
        if self._recording:
            self.ledger.record(PhaseCost(header_messages=len(hdr_sends), header_bytes=8 * len(hdr_sends)))
        handles = self._post(hdr_sends, hdr_recvs) if (hdr_sends or hdr_recvs) else []
        return {s: int(h.wait()[0]) for s, h in zip(srcs, handles)}

    def send(self, t: torch.Tensor, dst: int, fixed: bool = False) -> None:
        """Send a 1-D tensor. ``fixed=True`` only if the receiver passes ``numel`` to :meth:`recv`."""
        self.exchange([(dst, (t, "fixed") if fixed else t)], [])

    def recv(self, src: int, numel: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Receive a 1-D tensor; with ``numel=None`` the size comes from the sender's header."""
        spec = dtype if numel is None else (int(numel), dtype)
        return self.exchange([], [(src, spec)])[src]

    def sendrecv(
        self,
        t: torch.Tensor,
        dst: int,
        src: int,
        recv_numel: int | None = None,
        recv_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Send to ``dst`` and receive from ``src`` simultaneously (one round).

        Variable size unless ``recv_numel`` is given, in which case the partner must also call with
        its ``recv_numel`` (both sides fixed).
        """
        dtype = recv_dtype or t.dtype
        if recv_numel is None:
            return self.exchange([(dst, t)], [(src, dtype)])[src]
        return self.exchange([(dst, (t, "fixed"))], [(src, (int(recv_numel), dtype))])[src]

    # ------------------------------------------------------------------ collectives
    def _ring_cost(self, rounds_mult: int, nbytes_each_way: int) -> PhaseCost:
        P = self.world_size
        msgs = rounds_mult * (P - 1)
        return PhaseCost(msgs, msgs, nbytes_each_way, nbytes_each_way, msgs)

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """All ranks' tensors (same numel and dtype everywhere), in rank order."""
        t = _as_1d(t, "allgather")
        out = self._allgather(t)
        sizes = {x.numel() for x in out}
        if len(sizes) != 1:
            raise CommError(f"allgather needs equal sizes on every rank, got {sorted(sizes)}; use allgatherv")
        cost = self._ring_cost(1, (self.world_size - 1) * _nbytes(t))
        self._record(cost)
        self._charge_collective(cost)
        return out

    def allgather_into(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`allgather` into one flat tensor: rank ``r``'s ``t`` lands in
        ``out[r*m:(r+1)*m]`` (``m = t.numel()``, the same on every rank). No per-rank output tensors
        and no concatenation copy (dense all-gathers of large vectors). Same ledger as allgather."""
        t = _as_1d(t, "allgather_into")
        if out.dim() != 1 or out.numel() != self.world_size * t.numel() or out.dtype != t.dtype:
            raise CommError(f"allgather_into needs a 1-D {t.dtype} output of {self.world_size} x {t.numel()} "
                            f"elements, got {out.dtype} of shape {tuple(out.shape)}")
        self._allgather_into(t, out)
        cost = self._ring_cost(1, (self.world_size - 1) * _nbytes(t))
        self._record(cost)
        self._charge_collective(cost)
        return out

    def allgather_direct(self, t: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`allgather` of a tensor whose size every rank knows to be the same everywhere, by
        one batch of direct sends and receives (:meth:`_allgather_direct`) instead of a ring: the
        same ledger as :meth:`allgather` (``P - 1`` rounds, messages and ``(P - 1) * nbytes`` each
        way) and the same result; no size check (a rank with another size is a protocol error of
        the caller). For small, latency-bound gathers (histograms, counts): one batch of messages
        instead of ``P - 1`` dependent ring steps (larger messages are slower direct, see
        ``torchcomm.DIRECT_GATHER_MAX``; ``sparsync bench gather-routes`` measures both)."""
        t = _as_1d(t, "allgather_direct")
        out = self._allgather_direct(t)  # a virtual clock is charged per message by _post
        self._record(self._ring_cost(1, (self.world_size - 1) * _nbytes(t)))
        return out

    def allgatherv(self, t: torch.Tensor, counts: list[int] | None = None) -> list[torch.Tensor]:
        """All ranks' tensors of possibly different lengths (counts first, then padded all-gather).

        ``counts``: every rank's length when the caller knows them already (the same list on every
        rank): no count round. The ledger records the padded size, which is what actually travels.
        """
        t = _as_1d(t, "allgatherv")
        counts = self.gather_counts(t.numel()) if counts is None else [int(c) for c in counts]
        out = gather_padded(t, counts, self._allgather_equal)
        self._record_padded_gather(max(counts), t.element_size())
        return out

    def allgatherv_flat(self, t: torch.Tensor, counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """:meth:`allgatherv` into one flat tensor: ``(flat, counts)`` with rank ``r``'s tensor at
        ``flat[r*m : r*m + counts[r]]``, ``m = max(counts)`` (the rest of each slot is padding).
        No per-rank output tensors (gloo's list all-gather copies every rank's piece out of its
        flat buffer); the same ledger as :meth:`allgatherv`."""
        t = _as_1d(t, "allgatherv_flat")
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
        t = _as_1d(t, "allreduce")
        if out is None:
            out = torch.empty_like(t, memory_format=torch.contiguous_format)
        elif out is not t and (out.shape != t.shape or out.dtype != t.dtype or not out.is_contiguous()):
            raise CommError(f"allreduce out must be a contiguous {t.dtype} tensor of shape {tuple(t.shape)}, "
                            f"got {out.dtype} {tuple(out.shape)}")
        return t, out

    def _record_allreduce(self, t: torch.Tensor) -> None:
        P = self.world_size
        cost = self._ring_cost(2, 2 * (P - 1) * _nbytes(t) // P if P > 1 else 0)
        self._record(cost)
        self._charge_collective(cost)

    def alltoallv(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``parts[j]`` to rank j; returns the part every rank sent to this one (rank order)."""
        P = self.world_size
        if len(parts) != P:
            raise CommError(f"alltoallv needs one part per rank ({P}), got {len(parts)}")
        parts = [_as_1d(p, "alltoallv") for p in parts]
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
        t = _as_1d(t, "broadcast")
        out = self._broadcast(t, src)
        P = self.world_size
        nb = _nbytes(t)
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
        indices = _as_1d(indices, "sparse_allreduce_coo").to(torch.int64)
        values = _as_1d(values, "sparse_allreduce_coo")
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

    def check_same(self, value: int, what: str) -> None:
        """Raise on every rank if ``value`` differs across ranks (unrecorded control traffic)."""
        vals = self.allgather_control(torch.tensor([int(value)], dtype=torch.int64, device=self.device))
        vals = [int(v[0]) for v in vals]
        if len(set(vals)) > 1:
            raise ValueError(f"{what} differs across ranks: " + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(vals)))

    @property
    def clock(self) -> float | None:
        """Virtual time in seconds (ThreadComm with alpha/beta set); None on real backends."""
        return None
