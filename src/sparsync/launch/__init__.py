"""Run one function on P ranks: threads in this process, real gloo processes, or under torchrun.

``run_local(fn, world_size, *args, backend="thread"|"gloo", **kwargs)`` calls
``fn(comm, *args, **kwargs)`` on every rank and returns the per-rank results in rank order.

* ``"thread"``: a :class:`~sparsync.threadcomm.ThreadWorld` (any world size up to ``MAX_THREAD_RANKS`` = 256 in tests;
  optional virtual alpha-beta clock via ``alpha=``/``beta=``).
* ``"gloo"``: one OS process per rank, ``fork`` start method when it is safe (no CUDA context, no
  autograd device threads - :func:`autograd_threads_started` - and ``fn`` may be a closure), ``spawn``
  otherwise. Each child pins torch to one thread,
  rendezvous through a ``FileStore`` in a temporary directory (no port to race for, and it works
  across network namespaces), runs ``fn``, meets the others at a final barrier and exits with
  ``os._exit`` so no atexit hook can hang. The parent watches every child: the first exception on
  any rank kills the others at once and is re-raised here, same type, with the rank named; a child
  that dies without a word or a run past ``timeout`` is an error too. Never a hang.
* No orphans (docs/reliability.md): every rank asks the kernel for SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``) and also watches its parent pid; SIGTERM/SIGINT to the launcher
  kill every rank, remove the store and are then re-delivered to the handler that was installed
  before (so an :class:`~sparsync.cluster.EmulatedCluster` deletes its namespaces, and the process
  ends the way it would have); a small *reaper* process forked first removes the store (and runs
  :func:`on_orphan` callbacks) when the launcher dies even by SIGKILL (:func:`start_reaper`; an
  emulated cluster forks its own before its first namespace). Torchrun workers watch their agent
  the same way (:func:`comm_from_env`). Rank processes are named ``ss<launcher pid>r<rank>`` and stores
  ``sparsync-store-<launcher pid>-*`` so ``sparsync cluster cleanup`` finds leftovers of dead
  launchers (only ours).
* A rank that is stopped (SIGSTOP, a debugger) is named as the culprit when the others time out.
* ``timeout`` is a *stall* timeout, not a deadline: the run is stopped when no rank has made
  progress for ``timeout`` seconds - a collective that waits that long fails in the ranks, and the
  launcher watches the ranks' :func:`progress` beats (the training loop beats once per step, and
  every rank once when its process is up: the timeout counts once every rank is up, which may take
  ``STARTUP_S``; for a function that never beats, ``timeout`` counts from there, a deadline; the
  rendezvous, too, must complete within it). ``time_limit`` (default none) is the separate limit on
  the whole run.
* ``world_size`` of process ranks is bounded before anything starts (:func:`check_local_workers`:
  file descriptors, processes, memory, cores), with one line naming the limit that binds.
* ``placement``: an optional callable ``placement(rank) -> dict`` run in the child before the
  process group starts (the emulated cluster uses it to enter the rank's network namespace and set
  ``GLOO_SOCKET_IFNAME``).

Under ``torchrun``: :func:`comm_from_env` builds a TorchComm from the env:// variables and
:func:`torchrun_main` runs the same worker function as ``run_local`` would.

The parts, one job each: :mod:`.threads` and :mod:`.processes` (the two backends; :mod:`.blame`
names the culprit of a failed process run, :mod:`.failures` how it reaches the caller),
:mod:`.orphans` (ranks die with their launcher; reapers; signals), :mod:`.limits` (how many ranks
fit), :mod:`.torchrun`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..threadcomm import check_thread_world_size
from .failures import RankFailed, name_rank, proc_state
from .limits import (RANK_MEMORY, RANK_THREADS, RANKS_PER_CORE, check_local_workers, format_bytes,
                     local_worker_limit)
from .orphans import REAPERS, die_with_parent, on_orphan, rank_process_name, start_reaper, stop_reaper
from .processes import (AUTOGRAD_THREAD_PREFIX, STARTUP_S, STORE_PREFIX, _pickles, autograd_threads_started,
                        pick_start_method, progress, run_processes)
from .threads import run_threads
from .torchrun import comm_from_env, lost_peer_error, peer_table, torchrun_main

__all__ = ["run_local", "comm_from_env", "torchrun_main", "RankFailed", "on_orphan", "STORE_PREFIX",
           "rank_process_name", "peer_table", "lost_peer_error", "progress", "check_local_workers",
           "start_reaper", "stop_reaper", "autograd_threads_started", "STARTUP_S", "AUTOGRAD_THREAD_PREFIX",
           # re-exported from the parts
           "RANK_MEMORY", "RANK_THREADS", "RANKS_PER_CORE", "REAPERS", "die_with_parent", "format_bytes",
           "local_worker_limit", "proc_state"]

# private names of this module before it was split into parts
_name_rank, _pick_start_method, _pickles = name_rank, pick_start_method, _pickles


def run_local(fn: Callable, world_size: int, *args, backend: str = "thread", timeout: float = 120.0,
              alpha: float = 0.0, beta: float = 0.0, placement: Callable[[int], dict] | None = None,
              start_method: str | None = None, time_limit: float | None = None, env: dict | None = None,
              **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` ranks; return results in rank order.

    ``timeout``: the stall timeout (seconds without progress, see the module docstring);
    ``time_limit``: seconds for the whole run (None: no limit). ``backend="gloo"``: one process per
    rank (``start_method``: see :func:`~sparsync.launch.processes.pick_start_method`), ``comm`` a CPU
    :class:`~sparsync.torchcomm.TorchComm`; ranks that work on a GPU wrap the same group as
    ``TorchComm(device="cuda")``. ``env``: variables set in every rank process before anything else
    runs there (gloo only; e.g. ``{"CUDA_VISIBLE_DEVICES": ""}`` hides the GPUs from CPU ranks)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not timeout > 0 or (time_limit is not None and not time_limit > 0):
        raise ValueError(f"timeout and time_limit must be positive seconds, got {timeout!r}, {time_limit!r}")
    if env and backend != "gloo":
        raise ValueError("env applies to backend='gloo' (one process per rank); thread ranks share this process")
    if backend == "thread":
        check_thread_world_size(world_size)  # the one limit of the thread cluster, MAX_THREAD_RANKS
        return run_threads(fn, world_size, args, kwargs, timeout, alpha, beta, time_limit)
    if backend == "gloo":
        check_local_workers(world_size)
        return run_processes(fn, world_size, args, kwargs, timeout, placement, start_method, time_limit, env)
    raise ValueError(f"unknown backend {backend!r}; valid: 'thread', 'gloo'")
