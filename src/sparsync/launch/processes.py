"""Process ranks: ``run_local(..., backend="gloo")``, one OS process per rank, watched until all report.

Each rank process pins torch to one thread, enters its placement (e.g. a network namespace), meets
the others through a ``FileStore`` in a temporary directory (no port to race for, and it works
across network namespaces), runs ``fn``, meets them at a final barrier, ships its result or its
exception to the launcher over a pipe and exits with ``os._exit`` (no atexit hook can hang). The
launcher watches every pipe: the first error on any rank stops the others and is re-raised, with the
culprit named (:mod:`.blame`); a stall past ``timeout`` without a :func:`progress` beat of any rank,
or a run past ``time_limit``, is an error too. Every rank beats once when it is up; the stall timeout
counts once all are, and ranks not up within ``max(STARTUP_S, timeout)`` fail the run. Never a hang.

Ranks are forked where that is safe, spawned where CUDA is initialised or autograd's device threads
run here (:func:`pick_start_method`).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch

from .blame import blame_dead, blame_stopped, blame_stuck, how_died, reported_cause, stall_grace
from .failures import RankFailed, decode_report, encode_report, is_connection_error, name_rank
from .orphans import REAPERS, become_rank, rank_process_name, signals_stop_ranks, stop_reaper, watch_parent

__all__ = ["AUTOGRAD_THREAD_PREFIX", "STARTUP_S", "STORE_PREFIX", "autograd_threads_started", "pick_start_method",
           "progress", "run_processes"]

STORE_PREFIX = "sparsync-store-"


class _Heartbeat:
    """This rank process's slot in the launcher's shared array of last-progress times (None elsewhere)."""

    slot = None  # (shared array, rank)

    def beat(self) -> None:
        if self.slot is not None:
            self.slot[0][self.slot[1]] = time.monotonic()


_HEARTBEAT = _Heartbeat()  # one per process: a rank process of run_local is one rank


def progress() -> None:
    """Tell the launcher this rank made progress (the training loop calls it once per step): the
    stall timeout of :func:`run_local` counts from the latest beat of any rank. A no-op outside a
    process rank of ``run_local``."""
    _HEARTBEAT.beat()


def _child(rank, world_size, store_path, conn, fn, args, kwargs, timeout, placement, parent_pid, forked, beats,
           env=None):
    os.environ.update(env or {})  # first: before this process asks torch about any device
    import torch.distributed as dist

    from ..torchcomm import TorchComm

    status = "ok"
    try:
        become_rank(parent_pid, rank, forked)
        _HEARTBEAT.slot = (beats, rank)
        progress()  # the rank is up: a spawned rank's interpreter start is not a stall
        torch.set_num_threads(1)
        env = placement(rank) if placement else {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        os.environ.update(env or {})
        watch_parent(parent_pid)
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
        except Exception as why:  # noqa: BLE001 - an exception's __reduce__ may raise anything; ship its text
            exc = RankFailed(f"{type(e).__name__}: {e} (the exception itself could not be pickled: "
                             f"{type(why).__name__}: {why})")
        payload = ("error", (exc, tb))
    try:
        conn.send_bytes(encode_report(payload))
    except BaseException:  # noqa: BLE001
        status = "error"
    finally:
        conn.close()
    os._exit(0 if status == "ok" else 1)


#: seconds a rank process may take to start (to its first beat: a spawned rank imports torch and
#: the caller's modules first) before the run fails; the stall timeout counts once every rank is up
STARTUP_S = 120.0
#: Name prefix torch gives autograd's per-device worker threads (``pt_autograd_<device>``).
AUTOGRAD_THREAD_PREFIX = "pt_autograd_"


def autograd_threads_started() -> bool:
    """Whether autograd's per-device worker threads run in this process (Linux: thread names).

    torch starts them at the first backward pass on a machine where an accelerator is visible,
    whatever device that backward ran on; from then on a forked child cannot run a backward pass
    ("Unable to handle autograd's threading in combination with fork-based multiprocessing"), and
    the device-count query behind them has initialised the driver, so it cannot use CUDA either.
    On a CPU-only machine they never start. ``False`` where thread names cannot be read."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(AUTOGRAD_THREAD_PREFIX):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def pick_start_method(requested, payload=()):
    """``fork`` (fast; ``fn`` need not pickle) unless CUDA is initialised here, or autograd's device
    threads run (:func:`autograd_threads_started`) and ``payload`` (``fn``, its arguments, the
    placement) pickles: then ``spawn``. A forked child could not use CUDA after the first, nor run a
    backward pass after the second; a payload that does not pickle (a local function: collectives
    that need no backward pass) is still forked, and a backward pass in it fails with torch's error.
    An explicit ``requested`` method is kept. Only torch's flag is read for CUDA:
    ``torch.cuda.is_available()`` asks the driver, after which no forked child can use CUDA either
    (torch refuses: "Cannot re-initialize CUDA in forked subprocess") - a caller that did so and whose
    ranks use CUDA passes ``start_method="spawn"``, or sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` before
    asking."""
    if requested:
        return requested
    if torch.cuda.is_initialized():
        return "spawn"
    if not autograd_threads_started():
        return "fork"
    if _pickles(payload):
        return "spawn"
    warnings.warn("run_local: autograd's device threads run in this process (a backward pass ran on a machine "
                  "with a GPU), so forked ranks cannot run a backward pass; the function does not pickle "
                  "(a local function?), so its ranks are forked: pass a module-level function to have them "
                  "spawned", stacklevel=4)
    return "fork"


def _pickles(obj) -> bool:
    """Whether ``spawn`` can send ``obj`` (its pickler: tensors go to shared memory, as they would)."""
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.dumps(obj)
    except Exception:  # noqa: BLE001 - any failure to pickle (local objects, locks, open files) means fork
        return False
    return True


def run_processes(fn, world_size, args, kwargs, timeout, placement, start_method, time_limit=None,
                  env=None) -> list:
    """``fn(comm, *args, **kwargs)`` on ``world_size`` process ranks; the results in rank order.
    ``env`` hiding the GPUs (``CUDA_VISIBLE_DEVICES`` empty) from a torch built with CUDA: ``spawn``,
    since a forked child keeps the device count its parent may have read already."""
    if env and env.get("CUDA_VISIBLE_DEVICES") == "" and torch.version.cuda and not start_method:
        start_method = "spawn"
    ctx = mp.get_context(pick_start_method(start_method, (fn, args, kwargs, placement)))
    tmp = tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
    store_path = os.path.join(tmp, "store")
    procs, conns = [], []
    reaper = None
    beats = ctx.RawArray("d", world_size)  # each rank's latest progress() (time.monotonic, system-wide)
    with signals_stop_ranks():
        try:
            reaper = REAPERS.start_for_run(tmp)
            # a forked rank inherits the reapers' pipes and must close them; a spawned one does not
            forked = ctx.get_start_method() == "fork"
            for r in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, name=rank_process_name(os.getpid(), r),
                                args=(r, world_size, store_path, child_end, fn, args, kwargs, timeout, placement,
                                      os.getpid(), forked, beats, env))
                p.daemon = True
                p.start()
                child_end.close()
                procs.append(p)
                conns.append(parent_end)
            return _collect(procs, conns, world_size, timeout, beats, time_limit)
        finally:
            _kill_all(procs)
            for p in procs:
                p.join(timeout=5)
            shutil.rmtree(tmp, ignore_errors=True)
            stop_reaper(reaper)


def _collect(procs, conns, world_size, timeout, beats=None, time_limit=None):
    results: list[Any] = [None] * world_size
    pending = {c: r for r, c in enumerate(conns)}
    start = time.monotonic()
    while pending:
        now = time.monotonic()
        missing = sorted(pending.values())
        if time_limit is not None and now - start > time_limit:
            raise RankFailed(f"the run exceeded its time limit of {time_limit:g} s (--time-limit); ranks {missing} "
                             f"of {world_size} were still running and were stopped")
        if beats is not None and not all(beats):  # a rank is not up yet (a spawned one imports torch first)
            if now - start > max(STARTUP_S, timeout):
                _kill_all(procs)
                late = [r for r in range(world_size) if not beats[r]]
                raise RankFailed(f"ranks {late} of {world_size} did not start within "
                                 f"{max(STARTUP_S, timeout):g} s; every rank was stopped")
            last = now
        else:
            last = max(start, max(beats)) if beats is not None else start
        stall = timeout + stall_grace(timeout)
        if now - last > stall:
            blame_stopped(procs, world_size, None, f"no progress for {now - last:.0f} s")
            raise RankFailed(f"no progress for {now - last:.0f} s (the stall timeout, --timeout {timeout:g}): ranks "
                             f"{missing} of {world_size} were still running and were stopped")
        left = min(last + stall, start + time_limit if time_limit is not None else float("inf")) - now
        ready = mpc.wait(list(pending), timeout=max(0.01, min(left, 1.0)))
        for c in ready:
            r = pending.pop(c)
            try:
                data = c.recv_bytes()
            except (EOFError, OSError):
                procs[r].join(timeout=2)
                raise RankFailed(f"rank {r} of {world_size} died without reporting ({how_died(procs[r])})") from None
            status, value = decode_report(data)
            if status == "error":
                exc, tb = value
                then = f"rank {r} then failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                blame_stopped(procs, world_size, r, then)
                blame_stuck(procs, world_size, r, exc, pending, timeout)
                if is_connection_error(exc):  # a peer that died makes the others lose their connections
                    cause = reported_cause(pending)
                    if cause is not None:
                        _kill_all(procs)
                        r, (exc, tb) = cause
                        raise name_rank(exc, r, world_size, tb)
                    blame_dead(procs, world_size, r, then)
                _kill_all(procs)
                raise name_rank(exc, r, world_size, tb)
            results[r] = value
    return results


def _kill_all(procs):
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
