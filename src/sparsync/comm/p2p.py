"""Point-to-point calls of :class:`~sparsync.comm.Comm` (a mixin: the methods use the base class's
backend primitive ``_post`` and its ledger), and the size-header protocol of variable-size messages.

Cost (alpha-beta model, :mod:`sparsync.comm.ledger`): a batch (``send``, ``recv``, ``sendrecv``,
``exchange``, ``post``) is one message per payload; ``rounds += max(#sends, #recvs)`` (every message
posted pays one alpha at its sender, so a recursive-doubling step is 1 round and SparCML's direct
sends to P-1 peers are P-1 rounds).

Variable-size messages use a **size-header protocol**: the sender first sends one int64 element
count, then the payload (skipped when empty). We chose headers over fixed capacity because the
sparse algorithms' message sizes are data dependent and a capacity of ``numel`` would make every
message dense-sized. Algorithms that *know* the size (fixed-capacity blocks, SparDL) pass it to the
receive call and no header travels. Headers are recorded separately (``header_messages``,
``header_bytes``) and are not part of ``messages_sent``/``bytes_sent``/``rounds``, which follow the
documents' formulas; they travel in the same round as their payload.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .ledger import PhaseCost
from .messages import CommError, Handle, as_1d, nbytes

__all__ = ["PointToPoint"]


class PointToPoint:
    """Matched sends and receives of 1-D tensors between ranks, fixed or variable size."""

    def _check_peer(self, peer: int, what: str) -> int:
        peer = int(peer)
        if not 0 <= peer < self.world_size:
            raise CommError(f"{what}: peer {peer} is outside ranks 0..{self.world_size - 1}")
        if peer == self.rank:
            raise CommError(f"{what}: rank {self.rank} cannot message itself")
        return peer

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
        sends = [(self._check_peer(d, "post"), as_1d(t, "post")) for d, t in sends]
        recvs = [(self._check_peer(s, "post"), int(n), dt) for s, n, dt in recvs]
        cost = PhaseCost(
            messages_sent=sum(1 for _, t in sends if t.numel()),
            messages_received=sum(1 for _, n, _ in recvs if n),
            bytes_sent=sum(nbytes(t) for _, t in sends),
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
        hdr_sends = [(self._check_peer(d, "send"), torch.tensor([as_1d(t, "send").numel()],
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
