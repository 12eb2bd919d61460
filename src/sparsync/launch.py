"""Run one function on P ranks: threads in this process, real gloo processes, or under torchrun.

``run_local(fn, world_size, *args, backend="thread"|"gloo", **kwargs)`` calls
``fn(comm, *args, **kwargs)`` on every rank and returns the per-rank results in rank order.

* ``"thread"``: a :class:`~sparsync.threadcomm.ThreadWorld` (any world size up to 256 in tests;
  optional virtual alpha-beta clock via ``alpha=``/``beta=``).
* ``"gloo"``: one OS process per rank, ``fork`` start method when it is safe (no CUDA context and
  ``fn`` may be a closure; 0.1 s start-up), ``spawn`` otherwise. Each child pins torch to one thread,
  rendezvous through a ``FileStore`` in a temporary directory (no port to race for, and it works
  across network namespaces), runs ``fn``, meets the others at a final barrier and exits with
  ``os._exit`` so no atexit hook can hang. The parent watches every child: the first exception on
  any rank kills the others at once and is re-raised here, same type, with the rank named; a child
  that dies without a word or a run past ``timeout`` is an error too. Never a hang.
* ``placement``: an optional callable ``placement(rank) -> dict`` run in the child before the
  process group starts (the emulated cluster uses it to enter the rank's network namespace and set
  ``GLOO_SOCKET_IFNAME``).

Under ``torchrun``: :func:`comm_from_env` builds a TorchComm from the env:// variables and
:func:`torchrun_main` runs the same worker function as ``run_local`` would.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from .threadcomm import RankAborted, ThreadWorld

__all__ = ["run_local", "comm_from_env", "torchrun_main", "RankFailed"]


class RankFailed(RuntimeError):
    """A rank failed in a way that has no exception object to re-raise (crash, timeout)."""


def _name_rank(exc: BaseException, rank: int, world_size: int, tb: str = "") -> BaseException:
    exc.rank = rank
    note = f"raised on rank {rank} of {world_size}"
    if tb:
        note += f"; traceback on that rank:\n{tb}"
    try:
        exc.add_note(note)
    except AttributeError:  # Python < 3.11
        pass
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("rank "):
        exc.args = (f"rank {rank}: {exc.args[0]}",) + exc.args[1:]
    return exc


def run_local(fn: Callable, world_size: int, *args, backend: str = "thread", timeout: float = 120.0,
              alpha: float = 0.0, beta: float = 0.0, placement: Callable[[int], dict] | None = None,
              start_method: str | None = None, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` ranks; return results in rank order."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend == "thread":
        if world_size > 256:
            raise ValueError(f"the thread backend supports up to 256 ranks, got {world_size}")
        return _run_threads(fn, world_size, args, kwargs, timeout, alpha, beta)
    if backend == "gloo":
        return _run_processes(fn, world_size, args, kwargs, timeout, placement, start_method)
    raise ValueError(f"unknown backend {backend!r}; valid: 'thread', 'gloo'")


# ---------------------------------------------------------------------- threads
def _run_threads(fn, world_size, args, kwargs, timeout, alpha, beta):
    world = ThreadWorld(world_size, alpha=alpha, beta=beta, timeout=timeout)
    comms = world.comms()
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException, str]] = []

    def body(r):
        try:
            results[r] = fn(comms[r], *args, **kwargs)
        except RankAborted:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append((r, e, traceback.format_exc()))
            world.abort(f"rank {r} raised {type(e).__name__}: {e}")

    if world_size == 1:
        body(0)
    else:
        threads = [threading.Thread(target=body, args=(r,), name=f"sparsync-rank{r}", daemon=True)
                   for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        # the root cause: the first error that is not a consequence of another rank's abort
        roots = [x for x in errors if not _caused_by_abort(x[1])]
        r, e, _ = (roots or errors)[0]
        raise _name_rank(e, r, world_size)
    return results


def _caused_by_abort(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RankAborted):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


# ---------------------------------------------------------------------- processes
def _child(rank, world_size, store_path, conn, fn, args, kwargs, timeout, placement):
    import torch.distributed as dist

    from .torchcomm import TorchComm

    status = "ok"
    try:
        torch.set_num_threads(1)
        env = placement(rank) if placement else {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        os.environ.update(env or {})
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        comm = TorchComm()
        result = fn(comm, *args, **kwargs)
        dist.barrier()
        payload = ("ok", result)
    except BaseException as e:  # noqa: BLE001 - shipped to the parent
        status = "error"
        tb = traceback.format_exc()
        try:
            pickle.dumps(e)
            exc = e
        except Exception:
            exc = RankFailed(f"{type(e).__name__}: {e}")
        payload = ("error", (exc, tb))
    try:
        buf = io.BytesIO()
        torch.save(payload, buf)
        conn.send_bytes(buf.getvalue())
    except BaseException:  # noqa: BLE001
        status = "error"
    finally:
        conn.close()
    os._exit(0 if status == "ok" else 1)


def _pick_start_method(requested):
    if requested:
        return requested
    cuda_live = torch.cuda.is_available() and torch.cuda.is_initialized()
    return "spawn" if cuda_live else "fork"


def _run_processes(fn, world_size, args, kwargs, timeout, placement, start_method):
    ctx = mp.get_context(_pick_start_method(start_method))
    tmp = tempfile.mkdtemp(prefix="sparsync-store-")
    store_path = os.path.join(tmp, "store")
    procs, conns = [], []
    try:
        for r in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"sparsync-rank{r}",
                            args=(r, world_size, store_path, child_end, fn, args, kwargs, timeout, placement))
            p.daemon = True
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return _collect(procs, conns, world_size, timeout + 30.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs, conns, world_size, deadline_s):
    results: list[Any] = [None] * world_size
    pending = {c: r for r, c in enumerate(conns)}
    deadline = time.monotonic() + deadline_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(pending.values())
            raise RankFailed(f"ranks {missing} of {world_size} did not finish within {deadline_s:.0f}s")
        ready = mpc.wait(list(pending), timeout=min(left, 1.0))
        for c in ready:
            r = pending.pop(c)
            try:
                data = c.recv_bytes()
            except (EOFError, OSError):
                procs[r].join(timeout=2)
                raise RankFailed(f"rank {r} of {world_size} died without reporting "
                                 f"(exit code {procs[r].exitcode})") from None
            status, value = torch.load(io.BytesIO(data), weights_only=False)
            if status == "error":
                exc, tb = value
                _kill_all(procs)
                raise _name_rank(exc, r, world_size, tb)
            results[r] = value
    return results


def _kill_all(procs):
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------- torchrun
def comm_from_env(backend: str | None = None, timeout: float = 300.0):
    """A TorchComm for a process started by ``torchrun`` (env:// rendezvous: RANK, WORLD_SIZE, ...).

    ``backend`` defaults to NCCL when CUDA is available, gloo otherwise.
    """
    import torch.distributed as dist

    from .torchcomm import TorchComm

    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(f"not started by torchrun: environment variables {missing} are missing")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    return TorchComm()


def torchrun_main(fn: Callable, *args, backend: str | None = None, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` in this torchrun worker; returns this rank's result."""
    import torch.distributed as dist

    comm = comm_from_env(backend)
    try:
        return fn(comm, *args, **kwargs)
    finally:
        dist.barrier()
        dist.destroy_process_group()
