"""Parameter-server baseline (the SparCML thesis compares against one, §4.2.2, §5):
a synchronous sharded parameter server on the Comm's point-to-point messages.

``servers`` ranks (``0 .. servers-1``) each own a contiguous shard of the index space
(:func:`shard_bounds`; shard ``s`` = ``[b_s, b_{s+1})``, sizes differing by at most one). One call:

1. **push**: every rank cuts its sparse vector at the shard boundaries and sends shard ``s``'s part
   (re-based to the shard, in the stream format of :mod:`sparsync.sparse`) to server ``s``;
2. the server sums the ``P`` parts of its shard **in rank order** (``sparse.add``: stays sparse while
   smaller, switches to dense otherwise), so the result does not depend on arrival order;
3. **pull**: every server sends its summed shard to every other rank; each rank concatenates the
   shards in order. Every rank receives the same bytes, so the result is bitwise identical everywhere.

Workers that are also servers keep their own part locally (no self-messages). The model itself stays
on the workers (each applies the same summed update, as in the thesis' synchronous PS where workers
pull the model right after the server applied the sum): pulling the sum is pulling the update.

Cost (variable-size messages, one size header each): server ``s`` receives ``P-1`` parts of its shard
and sends its sum to ``P-1`` ranks; a non-server rank receives ``servers`` sums. With one server the
server's link carries ``P-1`` streams each way — the bottleneck the thesis' comparison shows; more
servers split it. Rounds on the critical path: 2 (push, pull). Used by the ``ps`` reducer
(:mod:`sparsync.reducers.ps`) and by ``train-linear --algorithm ps``.
"""

from __future__ import annotations

import torch

from ..sparse import SparseVec, add, decode, encode

__all__ = ["check_servers", "cut_shards", "ps_allreduce", "shard_bounds"]


def check_servers(servers, world_size: int) -> int:
    if isinstance(servers, bool) or int(servers) != servers or not 1 <= int(servers) <= world_size:
        raise ValueError(f"parameter server: servers must be an integer in [1, {world_size}], got {servers!r}")
    return int(servers)


def shard_bounds(numel: int, servers: int) -> list[int]:
    """``servers + 1`` boundaries: shard ``s`` has ``numel // servers`` (+1 for the first remainder) items."""
    q, rem = divmod(int(numel), int(servers))
    b = [0]
    for s in range(servers):
        b.append(b[-1] + q + (s < rem))
    return b


def cut_shards(sv: SparseVec, bounds: list[int]) -> list[SparseVec]:
    """``sv`` cut at the shard boundaries, each part re-based to its shard."""
    cuts = torch.searchsorted(sv.indices, torch.tensor(bounds, dtype=torch.int64, device=sv.indices.device)).tolist()
    return [SparseVec(sv.indices[cuts[s]:cuts[s + 1]] - bounds[s], sv.values[cuts[s]:cuts[s + 1]],
                      bounds[s + 1] - bounds[s], check=False) for s in range(len(bounds) - 1)]


def _concat(parts, bounds: list[int], numel: int, dtype, device) -> SparseVec | torch.Tensor:
    """Shards in order -> one payload over ``[0, numel)`` (sparse if every shard is, else dense)."""
    if all(isinstance(p, SparseVec) for p in parts):
        idx = torch.cat([p.indices + bounds[s] for s, p in enumerate(parts)])
        return SparseVec(idx, torch.cat([p.values for p in parts]), numel, check=False)
    out = torch.zeros(numel, dtype=dtype, device=device)
    for s, p in enumerate(parts):
        out[bounds[s]:bounds[s + 1]] = p.to_dense() if isinstance(p, SparseVec) else p
    return out


def ps_allreduce(sv: SparseVec, comm, servers: int = 1, **_) -> SparseVec | torch.Tensor:
    """Sum of every rank's ``sv`` through ``servers`` parameter-server ranks (module docstring)."""
    P, me = comm.world_size, comm.rank
    servers = check_servers(servers, P)
    n, dtype = sv.numel, sv.dtype
    bounds = shard_bounds(n, servers)
    mine = cut_shards(sv, bounds)
    if P == 1:
        return sv
    with comm.phase("ps:push"):
        sends = [(s, encode(mine[s])) for s in range(servers) if s != me]
        recvs = [(r, torch.uint8) for r in range(P) if r != me] if me < servers else []
        got = comm.exchange(sends, recvs)
    summed = None
    if me < servers:
        width = bounds[me + 1] - bounds[me]
        parts = [mine[me] if r == me else decode(got[r], width, dtype) for r in range(P)]
        summed = parts[0]
        for p in parts[1:]:
            summed = add(summed, p)
    with comm.phase("ps:pull"):
        sends = [(r, encode(summed, bounds[me + 1] - bounds[me])) for r in range(P) if r != me] if me < servers else []
        recvs = [(s, torch.uint8) for s in range(servers) if s != me]
        got = comm.exchange(sends, recvs)
    shards = [summed if s == me else decode(got[s], bounds[s + 1] - bounds[s], dtype) for s in range(servers)]
    return _concat(shards, bounds, n, dtype, sv.device)
