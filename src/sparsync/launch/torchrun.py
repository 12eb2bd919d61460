"""Under ``torchrun``: a communicator from the env:// variables, workers that die with their agent.

:func:`comm_from_env` builds a :class:`~sparsync.torchcomm.TorchComm` from torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); :func:`torchrun_main` runs the same worker function as
``run_local`` would. A survivor's gloo error about a lost peer is turned into one naming the lost
rank by :func:`lost_peer_error`, with the table of hosts and pids :func:`peer_table` gathers at start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from .failures import RankFailed, is_connection_error, process_alive
from .orphans import die_with_parent

__all__ = ["comm_from_env", "lost_peer_error", "peer_table", "torchrun_main"]

_WATCHING_PARENT: list[int] = []  # the agent pid this worker watches (one per process)


def comm_from_env(backend: str | None = None, timeout: float = 300.0, die_with_agent: bool | None = None):
    """A TorchComm for a process started by ``torchrun`` (env:// rendezvous: RANK, WORLD_SIZE, ...).

    ``backend`` defaults to NCCL when there is a CUDA device for every local rank (NCCL refuses two
    ranks on one GPU), gloo otherwise; an explicit NCCL request with fewer GPUs than local ranks is a
    one-line ``ValueError``. ``die_with_agent`` (default:
    when torchrun's agent started us, ``TORCHELASTIC_RUN_ID`` set): this worker gets SIGKILL when its
    parent - the agent - dies (:func:`~sparsync.launch.die_with_parent`), as ``run_local``'s ranks do,
    so a killed agent leaves no worker training on.
    """
    import torch.distributed as dist

    from ..torchcomm import TorchComm

    if die_with_agent is None:
        die_with_agent = "TORCHELASTIC_RUN_ID" in os.environ
    if die_with_agent and not _WATCHING_PARENT:
        die_with_parent()
        _WATCHING_PARENT.append(os.getppid())
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(f"not started by torchrun: environment variables {missing} are missing")
        local_rank, local_ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = backend or ("nccl" if gpus >= local_ranks else "gloo")
        if backend == "nccl":
            if local_rank >= gpus:
                raise ValueError(f"NCCL needs a GPU per local rank: local rank {local_rank} of {local_ranks}, "
                                 f"{gpus} CUDA devices here (use backend='gloo')")
            torch.cuda.set_device(local_rank)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
        # under `torchrun --max-restarts` every attempt shares the agent's store: keys of a dead
        # attempt (its ranks' gloo addresses) would make the next attempt connect to dead ports
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"sparsync/attempt{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
    return TorchComm()


def peer_table(comm) -> list[tuple[str, int]]:
    """(host name, pid) of every rank, in rank order (one all-gather at start; for :func:`lost_peer_error`)."""
    import socket

    import torch.distributed as dist

    out: list = [None] * comm.world_size
    dist.all_gather_object(out, (socket.gethostname(), os.getpid()))
    return [tuple(x) for x in out]


def lost_peer_error(exc: BaseException, peers, rank: int) -> BaseException:
    """Turn gloo's "Connection closed by peer [addr]:port" on a survivor into a RankFailed that
    names the lost rank: a peer on this host whose process is gone (checked for 2 s), else the
    ranks on other hosts it may have been. Other errors are returned unchanged."""
    import socket

    text = str(exc)
    if not is_connection_error(exc):
        return exc
    host = socket.gethostname()
    local = {r: pid for r, (h, pid) in enumerate(peers) if h == host and r != rank}
    end = time.monotonic() + 2.0
    gone = []
    while not gone and time.monotonic() < end:
        gone = [r for r, pid in local.items() if not process_alive(pid)]
        if not gone:
            time.sleep(0.1)
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    if gone:
        what = ", ".join(f"rank {r} (pid {local[r]} on {host})" for r in gone)
        return RankFailed(f"rank {rank}: lost {what}: its process is gone; gloo said: {first}")
    remote = sorted(r for r, (h, _) in enumerate(peers) if h != host)
    where = f"one of ranks {remote} on other hosts" if remote else "a peer whose process is still alive"
    return RankFailed(f"rank {rank}: lost the connection to {where}; gloo said: {first}")


def torchrun_main(fn: Callable, *args, backend: str | None = None, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` in this torchrun worker; returns this rank's result."""
    import torch.distributed as dist

    comm = comm_from_env(backend)
    try:
        return fn(comm, *args, **kwargs)
    finally:
        dist.barrier()
        dist.destroy_process_group()
