"""How many ranks this machine can run, bounded before anything starts, with the limit that binds named.

:func:`local_worker_limit` takes the smallest of memory, file descriptors, processes/threads and
cores; :func:`check_local_workers` turns a ``world_size`` above it into one line naming that limit.
"""

from __future__ import annotations

import os

__all__ = ["RANKS_PER_CORE", "RANK_MEMORY", "RANK_THREADS", "check_local_workers", "format_bytes",
           "local_worker_limit"]

#: per rank process, measured for a forked gloo rank training digits-mlp: ~45 threads at most
#: (torch's and gloo's pools), ~120 MiB of private memory beside the shared pages of the fork
RANK_THREADS, RANK_MEMORY = 48, 120 << 20
#: ranks per core beyond which a run only queues (each rank's collectives wait on the others)
RANKS_PER_CORE = 64


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            v = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return None if v == "max" else int(v) if v.isdigit() else None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pids_max() -> int | None:
    """The pids limit of this process's cgroup (v2; v1's pids controller), None if unlimited/unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            rows = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for _, ctrl, path in rows:
        if ctrl in ("", "pids"):
            base = "/sys/fs/cgroup" if ctrl == "" else "/sys/fs/cgroup/pids"
            v = _read_int(os.path.join(base, path.lstrip("/"), "pids.max"))
            if v is not None:
                return v
    return None


def local_worker_limit(per_rank_memory: int = RANK_MEMORY, processes: bool = True) -> tuple[int, str]:
    """``(bound, what binds)``: how many ranks this machine can run, the smallest of memory
    (MemAvailable / ``per_rank_memory``) and, for process ranks (``processes``), file descriptors
    (the launcher holds ~4 per rank: RLIMIT_NOFILE), processes and threads (RLIMIT_NPROC, the
    cgroup's pids.max: ~48 threads per rank) and cores (64 ranks per core)."""
    import resource

    bounds = []
    mem = _mem_available()
    if mem is not None:
        bounds.append((mem // max(1, per_rank_memory),
                       f"the available memory ({format_bytes(mem)}; ~{format_bytes(per_rank_memory)} per rank)"))
    if not processes:
        return min(bounds) if bounds else (1 << 62, "nothing")
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile != resource.RLIM_INFINITY:
        bounds.append(((nofile - 64) // 4, f"the open-file limit (ulimit -n {nofile}; ~4 per rank)"))
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if nproc != resource.RLIM_INFINITY and os.geteuid() != 0:
        bounds.append((nproc // RANK_THREADS,
                       f"the process limit (ulimit -u {nproc}; ~{RANK_THREADS} threads per rank)"))
    pids = _pids_max()
    if pids is not None:
        bounds.append((pids // RANK_THREADS, f"the cgroup's pids.max {pids} (~{RANK_THREADS} threads per rank)"))
    cores = os.cpu_count() or 1
    bounds.append((RANKS_PER_CORE * cores, f"the cores ({cores}; at most {RANKS_PER_CORE} ranks per core)"))
    return min(bounds)


def check_local_workers(world_size: int, per_rank_memory: int = RANK_MEMORY, what: str = "--workers",
                        processes: bool = True, hint: str = "for more ranks use several machines (torchrun)") -> None:
    """ValueError (one line, naming the limit that binds) when ``world_size`` ranks cannot run here."""
    bound, why = local_worker_limit(per_rank_memory, processes)
    if world_size > bound:
        fits = "not even one rank fits" if bound < 1 else f"at most {bound} local ranks fit"
        raise ValueError(f"{what} {world_size}: {fits} here, by {why}; {hint}")


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style size (B, KiB, ... EiB, then powers of ten of EiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.3g} EiB"
