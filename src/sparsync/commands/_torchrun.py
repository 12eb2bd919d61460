"""``sparsync train`` as one process of a torchrun job (``torchrun ... -m sparsync.cli train ...``):
:func:`under_torchrun` tells, :func:`run_torchrun` checks, prepares the run directory on rank 0
(resuming it after an elastic restart of the same job, :func:`torchrun_job`) and trains on every rank.
"""

from __future__ import annotations

import json
import os

from ._preflight import preflight
from ._summary import print_summary

__all__ = ["run_torchrun", "torchrun_job", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (its rendezvous variables are set)."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_torchrun(cfg, args) -> int:
    """One process of a torchrun job: rank 0 prepares the run directory, every rank trains."""
    import torch.distributed as dist

    from ..launch import comm_from_env, lost_peer_error, peer_table
    from ..train.loop import train_worker
    from ..train.runs import CheckpointError, RunDir, RunExists, run_job

    cfg.network = "torchrun"
    preflight(cfg, network=False)
    comm = comm_from_env("gloo")  # CPU training loop; the library's SparseDDP also runs on NCCL
    if comm.world_size != cfg.workers:
        cfg.workers = comm.world_size  # torchrun decides the world size
    path = os.path.join(cfg.runs_dir, cfg.name)
    info = [None]
    rd = None
    if comm.rank == 0:
        resume, force, job = args.resume, args.force, torchrun_job()
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 and run_job(path) == job:
            # elastic restart (torchrun --max-restarts) of a run THIS job created: continue it from its
            # latest complete checkpoint, or start it over if it died before the first one
            # (docs/reliability.md). Any other directory gets what the first attempt got: a refusal stays one.
            resume = RunDir(path).latest_step() is not None
            force = not resume
        try:
            rd, resume_info = RunDir.prepare(cfg, force=force, resume=resume, job=job)  # locked until the end
            info = [json.dumps({"resume": resume_info})]
        except (OSError, CheckpointError, RunExists) as e:  # tell the other ranks, do not leave them waiting
            info = [json.dumps({"error": f"rank 0: {type(e).__name__}: {e}", "kind": type(e).__name__})]
    dist.broadcast_object_list(info, src=0)
    got = json.loads(info[0])
    if "error" in got:
        dist.destroy_process_group()
        raise (RunExists if got["kind"] in ("RunExists", "RunBusy") else CheckpointError)(got["error"])
    resume_info = got["resume"]
    peers = peer_table(comm)
    try:
        summary = train_worker(comm, cfg.to_dict(), path, resume_info)
    except RuntimeError as e:  # a survivor of a lost rank: name it instead of gloo's peer address
        raise lost_peer_error(e, peers, comm.rank) from e
    if comm.rank == 0:
        rd.write_summary(summary)
        print_summary(summary, cfg)
    dist.barrier()
    dist.destroy_process_group()
    if rd is not None:
        rd.release()
    return 0


def torchrun_job() -> str:
    """This torchrun job's identity, the same in every restart of it: the rendezvous id when one was
    given, else the agent (this worker's parent) on this host."""
    import socket

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    return f"torchrun:{socket.gethostname()}:{os.getppid()}"
