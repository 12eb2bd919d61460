"""Asynchronous sharded parameter server with bounded staleness, on ``torch.distributed`` point-to-point.

The SparCML thesis' MPI-SGD compares its sparse all-reduce with a synchronous and an *asynchronous*
parameter server (thesis §4.2.2 "Aggregation Strategies"; §2.1: "when dealing with asynchronous
data-parallel SGD ... one can only rely on the parameter-server paradigm").
The thesis does not bound the staleness; we add the Stale Synchronous Parallel bound ``s`` (Ho et al.
2013) so that ``s = 0`` is the synchronous server and ``s > 0`` lets workers run ahead.

Roles (as the thesis' ``GetWorkerNumber``): of ``P`` ranks, ``0 .. S-1`` are **servers** that only
serve, ``S .. P-1`` are **workers** ``0 .. W-1`` (``W = P - S >= 1``). Server ``k`` owns shard ``k``
of the index space (:func:`~sparsync.ps.sync.shard_bounds`) and runs :class:`~sparsync.ps.shard.ShardState`
(the update and staleness rules are documented there). A worker's step ``c``:

1. **pull**: to every server, a header ``[PULL, c, have, c - s]``; the server answers once its version
   ``v >= c - s`` with ``[v, nbytes]`` and the shard's coordinates written after version ``have`` (the
   stream format of :mod:`sparsync.sparse`), so the worker holds exactly the shard at version ``v``;
2. compute the gradient on its slice of the step's global batch;
3. **push**: to every server, a header ``[PUSH, c, v, count, nbytes, c + 1 - s]`` and its part of the
   gradient (indices re-based to the shard + values, or dense when not smaller) — non-blocking; the
   header's last field is step ``c + 1``'s pull request (step 1 of the next step without a message).

A worker never waits for another worker except through rule 1, i.e. only when it is ``s`` steps ahead
of the slowest one. ``FINISH`` tells a server that a worker pushes no more (steps from its clock on are
applied without it); it is answered with the final shard once every worker finished, and then the
server returns. Every receive has a timeout naming the peer and the step; a worker waits twice as long
for a reply as the server waits for any worker, so a stuck worker is reported by the server, by name
and step.

Messages per worker step and server: 1 header + 1 payload out, 1 header + 1 payload in (48 + 16 bytes
of headers; a pull that needs a newer version than the one piggybacked, as at an epoch's end, adds one
header). The server's link carries every worker's pushes and pulls: with one server it is the
bottleneck, as in the synchronous PS (:mod:`sparsync.ps.sync`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..sparse import SparseVec, decode, encode
from .shard import ShardState, check_staleness
from .sync import cut_shards, shard_bounds
from .transport import GlooTransport

__all__ = ["PSClient", "check_async_servers", "serve", "transport_for"]

PUSH, PULL, FINISH = 1, 2, 3
DONE = -1  # "required version" of a FINISH: answered with the final shard once every worker finished
NO_PULL = -2  # a PUSH that asks for no model in return
HDR = 6  # int64 header: kind, step, version held, count-or-required, payload bytes, pull requested by a PUSH
TAG_HDR, TAG_DATA, TAG_REPLY, TAG_REPLY_DATA = 1, 2, 3, 4


def check_async_servers(servers, world_size: int) -> int:
    """Dedicated server ranks: at least one, and at least one worker left."""
    if isinstance(servers, bool) or int(servers) != servers or not 1 <= int(servers) < world_size:
        raise ValueError(f"asynchronous parameter server: servers must be an integer in [1, {world_size - 1}] "
                         f"(P = {world_size} ranks, at least one of them a worker), got {servers!r}")
    return int(servers)


def transport_for(comm, timeout: float) -> GlooTransport:
    """The point-to-point transport on ``comm``'s process group (a ``torch.distributed`` Comm only)."""
    group = getattr(comm, "group", None)
    if not dist.is_initialized() or dist.get_world_size(group) != comm.world_size:
        raise ValueError("the asynchronous parameter server runs on torch.distributed point-to-point: "
                         "use backend 'gloo' (the thread backend has no any-source receive)")
    return GlooTransport(group, timeout)


def _header(*fields) -> torch.Tensor:
    return torch.tensor(list(fields) + [0] * (HDR - len(fields)), dtype=torch.int64)


def serve(tr: GlooTransport, numel: int, servers: int, staleness: int, lr: float, l2: float = 0.0,
          dtype=torch.float32) -> ShardState:
    """Run server ``tr.rank``'s shard until every worker finished; returns the final state (model
    shard ``w``, ``version``, per-push ``log``)."""
    me, W = tr.rank, tr.world_size - servers
    b = shard_bounds(numel, servers)
    width = b[me + 1] - b[me]
    st = ShardState(width, W, staleness, lr, l2, dtype)
    waiting: list[tuple[int, int, int, int]] = []  # pulls not answerable yet: (worker, step, have, required)
    while not st.done:
        running = [q for q in range(W) if st.final[q] is None]
        slow = [q for q in running if st.clock[q] == min(st.clock[r] for r in running)]
        src, h = tr.recv_any(HDR, torch.int64, TAG_HDR,
                             f"server {me} (version {st.version}) waiting for any worker; slowest: "
                             + ", ".join(f"worker {q} at step {st.clock[q]}" for q in slow))
        kind, step, a, c, nbytes, then = h.tolist()
        q = src - servers
        if kind == PUSH:
            buf = tr.recv(src, nbytes, torch.uint8, TAG_DATA, f"server {me}: push of worker {q} step {step}")
            st.push(q, step, a, c, decode(buf, width, dtype))
            if then != NO_PULL:
                waiting.append((q, step + 1, a, then))
        elif kind == PULL:
            waiting.append((q, step, a, c))
        elif kind == FINISH:
            st.finish(q)
            waiting.append((q, step, a, DONE))
        else:
            raise ValueError(f"server {me}: unknown message kind {kind} from rank {src}")
        still = []
        for q, step, have, required in waiting:
            if st.done if required == DONE else st.ready(required):
                payload = encode(st.delta(have), width)
                tr.isend(q + servers, _header(st.version, payload.numel())[:2], TAG_REPLY)
                tr.isend(q + servers, payload, TAG_REPLY_DATA)
            else:
                still.append((q, step, have, required))
        waiting = still
    tr.flush(f"server {me}: delivering the last replies")
    return st


class PSClient:
    """A worker's view: the full model ``w`` (each shard at the version last pulled from its server)."""

    def __init__(self, tr: GlooTransport, numel: int, servers: int, staleness: int, dtype=torch.float32):
        self.tr, self.servers, self.s = tr, servers, check_staleness(staleness)
        self.q = tr.rank - servers
        self.bounds = shard_bounds(numel, servers)
        self.w = torch.zeros(int(numel), dtype=dtype)
        self.have = [0] * servers  # version of each shard held
        self.clock = 0             # steps pushed
        self._asked: int | None = None  # version requested along with the last push, reply not read yet

    def pull(self, required: int | None = None) -> list[int]:
        """Bring every shard to a version ``>= required`` (default ``clock - s``: the staleness rule;
        ``clock`` itself: every step pushed so far applied). Returns the versions now held.

        The pull the last :meth:`push` asked for is read first; a PULL goes only to the servers whose
        shard is still older than ``required``."""
        self._read_asked()
        required = max(0, self.clock - self.s) if required is None else int(required)
        behind = [k for k in range(self.servers) if self.have[k] < required]
        for k in behind:
            self.tr.isend(k, _header(PULL, self.clock, self.have[k], required), TAG_HDR)
        return self._receive_model(required, behind)

    def _read_asked(self) -> None:
        if self._asked is not None:
            asked, self._asked = self._asked, None
            self._receive_model(asked, range(self.servers))

    def _receive_model(self, required: int, servers) -> list[int]:
        c = self.clock
        for k in servers:
            lo, hi = self.bounds[k], self.bounds[k + 1]
            what = (f"worker {self.q}: reply of server {k} to the pull of step {c} (needs version {required})"
                    if required != DONE else f"worker {self.q}: final model from server {k} (after step {c})")
            # a reply may wait for the slowest worker; the server times out first and names it
            v, nbytes = self.tr.recv(k, 2, torch.int64, TAG_REPLY, what, 2 * self.tr.timeout).tolist()
            d = decode(self.tr.recv(k, nbytes, torch.uint8, TAG_REPLY_DATA, what), hi - lo, self.w.dtype)
            if isinstance(d, SparseVec):
                self.w[lo + d.indices] = d.values
            else:
                self.w[lo:hi] = d
            self.have[k] = v
        return list(self.have)

    def push(self, grad: SparseVec, count: int, then_pull: bool = True) -> None:
        """Send step ``clock``'s gradient (the sum over ``count`` samples) to the shard owners; with
        ``then_pull`` the same header asks for the next step's model (one message less per step)."""
        self._read_asked()
        nxt = max(0, self.clock + 1 - self.s) if then_pull else NO_PULL
        for k, part in enumerate(cut_shards(grad, self.bounds)):
            payload = encode(part, part.numel)
            self.tr.isend(k, _header(PUSH, self.clock, self.have[k], count, payload.numel(), nxt), TAG_HDR)
            self.tr.isend(k, payload, TAG_DATA)
        self.clock += 1
        self._asked = nxt if then_pull else None

    def finish(self) -> torch.Tensor:
        """No more pushes from this worker; waits for every worker to finish and returns the final
        model (every pushed step applied: the same bits on every worker)."""
        self._read_asked()
        for k in range(self.servers):
            self.tr.isend(k, _header(FINISH, self.clock, self.have[k]), TAG_HDR)
        self._receive_model(DONE, range(self.servers))
        self.tr.flush(f"worker {self.q}: delivering its last pushes")
        return self.w
