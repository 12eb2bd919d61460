"""Run one function on P ranks: threads in this process, real gloo processes, or under torchrun.

``run_local(fn, world_size, *args, backend="thread"|"gloo", **kwargs)`` calls
``fn(comm, *args, **kwargs)`` on every rank and returns the per-rank results in rank order.

* ``"thread"``: a :class:`~sparsync.threadcomm.ThreadWorld` (any world size up to ``MAX_THREAD_RANKS`` = 256 in tests;
  optional virtual alpha-beta clock via ``alpha=``/``beta=``).
* ``"gloo"``: one OS process per rank, ``fork`` start method when it is safe (no CUDA context and
  ``fn`` may be a closure; 0.1 s start-up), ``spawn`` otherwise. Each child pins torch to one thread,
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
  rendezvous, too, must complete within it). ``time_limit`` (default none) is the separate limit on the whole run.
* ``world_size`` of process ranks is bounded before anything starts (:func:`check_local_workers`:
  file descriptors, processes, memory, cores), with one line naming the limit that binds.
* ``placement``: an optional callable ``placement(rank) -> dict`` run in the child before the
  process group starts (the emulated cluster uses it to enter the rank's network namespace and set
  ``GLOO_SOCKET_IFNAME``).

Under ``torchrun``: :func:`comm_from_env` builds a TorchComm from the env:// variables and
:func:`torchrun_main` runs the same worker function as ``run_local`` would.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import contextlib
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
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch

from .threadcomm import RankAborted, ThreadWorld, check_thread_world_size

__all__ = ["run_local", "comm_from_env", "torchrun_main", "RankFailed", "on_orphan", "STORE_PREFIX",
           "rank_process_name", "peer_table", "lost_peer_error", "progress", "check_local_workers",
           "start_reaper", "stop_reaper"]

STORE_PREFIX = "sparsync-store-"
_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1


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
              start_method: str | None = None, time_limit: float | None = None, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` ranks; return results in rank order.

    ``timeout``: the stall timeout (seconds without progress, see the module docstring);
    ``time_limit``: seconds for the whole run (None: no limit). ``backend="gloo"``: one process per
    rank (``start_method``: see :func:`_pick_start_method`), ``comm`` a CPU
    :class:`~sparsync.torchcomm.TorchComm`; ranks that work on a GPU wrap the same group as
    ``TorchComm(device="cuda")``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not timeout > 0 or (time_limit is not None and not time_limit > 0):
        raise ValueError(f"timeout and time_limit must be positive seconds, got {timeout!r}, {time_limit!r}")
    if backend == "thread":
        check_thread_world_size(world_size)  # the one limit of the thread cluster, MAX_THREAD_RANKS
        return _run_threads(fn, world_size, args, kwargs, timeout, alpha, beta, time_limit)
    if backend == "gloo":
        check_local_workers(world_size)
        return _run_processes(fn, world_size, args, kwargs, timeout, placement, start_method, time_limit)
    raise ValueError(f"unknown backend {backend!r}; valid: 'thread', 'gloo'")


# ---------------------------------------------------------------------- limits
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


# ---------------------------------------------------------------------- threads
def _run_threads(fn, world_size, args, kwargs, timeout, alpha, beta, time_limit=None):
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
        end = None if time_limit is None else time.monotonic() + time_limit
        for t in threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in threads):  # past the time limit: stop every rank at its next collective
            world.abort(f"the run exceeded its time limit of {time_limit:g} s")
            raise RankFailed(f"the run exceeded its time limit of {time_limit:g} s (--time-limit); every rank was "
                             "stopped")
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


# ---------------------------------------------------------------------- orphans
_ORPHAN_CALLBACKS: list[Callable[[], object]] = []
_REAPER_FDS: set[int] = set()  # write ends of this process's reapers' pipes (closed in every forked child)
_HEARTBEAT = None  # (shared array of last-progress times, rank) in a rank process of run_local
_libc = None


def progress() -> None:
    """Tell the launcher this rank made progress (the training loop calls it once per step): the
    stall timeout of :func:`run_local` counts from the latest beat of any rank. A no-op outside a
    process rank of ``run_local``."""
    hb = _HEARTBEAT
    if hb is not None:
        hb[0][hb[1]] = time.monotonic()


def on_orphan(fn: Callable[[], object]) -> Callable[[], None]:
    """Register ``fn()`` for the reaper: it runs when a launcher dies without cleaning up (SIGKILL).

    The reaper of a ``run_local`` call is forked when the call starts, with a copy of the callbacks
    registered by then. Returns a function that unregisters ``fn``.
    """
    _ORPHAN_CALLBACKS.append(fn)

    def remove():
        with contextlib.suppress(ValueError):
            _ORPHAN_CALLBACKS.remove(fn)

    return remove


def rank_process_name(launcher_pid: int, rank: int) -> str:
    """The kernel name (``comm``, 15 chars max) of a rank process: ``ss<launcher pid>r<rank>``."""
    return f"ss{launcher_pid}r{rank}"


def _prctl(option: int, arg) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        value = ctypes.c_char_p(arg) if isinstance(arg, bytes) else ctypes.c_ulong(int(arg))
        return _libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the parent-pid watch still works
        return False


def _close_reaper_fds() -> None:
    """In a forked child: only the launcher may hold its reapers' pipes open."""
    for fd in list(_REAPER_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _REAPER_FDS.clear()


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGKILL this process when its parent dies: ``prctl(PR_SET_PDEATHSIG)`` (fires when the
    parent's thread that started us ends) and a thread that watches the parent pid (belt and
    braces, and non-Linux). Exits at once if the parent is already gone."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    _watch_parent(parent_pid)


def _die_with_parent(parent_pid: int, rank: int, reaper_fd: int | None) -> None:
    """In a fresh rank process: get SIGKILL when the launcher dies, default signal dispositions.

    SIGTERM kills the rank; SIGINT is ignored (a terminal's Ctrl-C reaches the whole process group:
    the launcher decides, and kills the ranks). PR_SET_PDEATHSIG fires when the thread that forked
    us ends; that thread waits in ``_collect`` for as long as ranks run.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if reaper_fd is not None:
        _close_reaper_fds()
    _prctl(_PR_SET_NAME, rank_process_name(parent_pid, rank).encode())
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)


def _watch_parent(parent_pid: int) -> None:
    """Belt and braces for PR_SET_PDEATHSIG (and non-Linux): SIGKILL ourselves once reparented."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="sparsync-parent-watch", daemon=True).start()


def start_reaper(cleanup: Callable[[], object], name: bytes = b"sparsync-reaper") -> tuple[int, int] | None:
    """Fork a reaper that runs ``cleanup()`` if this process dies without :func:`stop_reaper` (even
    by SIGKILL: the reaper holds the read end of a pipe only this process writes, and sees it close).
    Returns (pid, pipe write end), or None where there is no fork."""
    if not hasattr(os, "fork"):
        return None
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the reaper only reads
        pid = os.fork()
    if pid:
        os.close(r)
        _REAPER_FDS.add(w)
        return pid, w
    try:  # the reaper
        os.close(w)
        _close_reaper_fds()  # other reapers must see their launcher's death, not wait for ours
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # it must outlive the launcher to clean up after it
        _prctl(_PR_SET_NAME, name)
        said = b""
        while chunk := os.read(r, 64):
            said += chunk
        if b"done" not in said:
            time.sleep(0.1)  # the ranks get SIGKILL from the kernel; let them go first
            with contextlib.suppress(BaseException):
                cleanup()
    finally:
        os._exit(0)


def stop_reaper(reaper) -> None:
    """Tell a reaper of :func:`start_reaper` that all went well (it exits without cleaning up)."""
    if reaper is None:
        return
    pid, w = reaper
    _REAPER_FDS.discard(w)
    with contextlib.suppress(OSError):
        os.write(w, b"done")
    with contextlib.suppress(OSError):
        os.close(w)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _start_reaper(store_dir: str) -> tuple[int, int] | None:
    """The reaper of one ``run_local`` call: the :func:`on_orphan` callbacks, then the store."""
    callbacks = list(_ORPHAN_CALLBACKS)

    def cleanup():
        for fn in callbacks:
            with contextlib.suppress(BaseException):
                fn()
        shutil.rmtree(store_dir, ignore_errors=True)

    return start_reaper(cleanup)


_stop_reaper = stop_reaper


class _Terminated(BaseException):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


@contextlib.contextmanager
def _signals_stop_ranks():
    """While ranks run, SIGTERM/SIGINT raise in the launcher, so ``finally`` kills the ranks and
    removes the store; then the previous handlers are restored and the signal is re-delivered to
    them (an EmulatedCluster's handler deletes its namespaces; SIG_DFL ends the process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        h = signal.getsignal(sig)
        if h is None or h == signal.SIG_IGN:  # a C handler we could not restore, or ignored: leave it
            continue
        prev[sig] = h
        signal.signal(sig, _raise_terminated)
    got = None
    try:
        yield
    except _Terminated as t:
        got = t.signum
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)
    if got is not None:
        os.kill(os.getpid(), got)  # the previous handler runs here (and usually raises or exits)
        raise RankFailed(f"the launcher received {signal.Signals(got).name}; every rank was stopped")


# ---------------------------------------------------------------------- processes
def _child(rank, world_size, store_path, conn, fn, args, kwargs, timeout, placement, parent_pid, reaper_fd, beats):
    import torch.distributed as dist

    from .torchcomm import TorchComm

    global _HEARTBEAT
    status = "ok"
    try:
        _die_with_parent(parent_pid, rank, reaper_fd)
        _HEARTBEAT = (beats, rank)
        progress()  # the rank is up: a spawned rank's interpreter start is not a stall
        torch.set_num_threads(1)
        env = placement(rank) if placement else {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        os.environ.update(env or {})
        _watch_parent(parent_pid)
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
        buf = io.BytesIO()
        torch.save(payload, buf)
        conn.send_bytes(buf.getvalue())
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


def _pick_start_method(requested, payload=()):
    """``fork`` (fast; ``fn`` need not pickle) unless CUDA is initialised here, or autograd's device
    threads run (:func:`autograd_threads_started`) and ``payload`` (``fn``, its arguments, the
    placement) pickles: then ``spawn``. A forked child could not use CUDA after the first, nor run a
    backward pass after the second; a payload that does not pickle (a local function: collectives
    that need no backward pass) is still forked, and a backward pass in it fails with torch's error.
    Only torch's flag is read for CUDA: ``torch.cuda.is_available()`` asks the driver, after which no
    forked child can use CUDA either (torch refuses: "Cannot re-initialize CUDA in forked
    subprocess") - a caller that did so and whose ranks use CUDA passes ``start_method="spawn"``, or
    sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` before asking."""
    if requested:
        return requested
    if torch.cuda.is_initialized():
        return "spawn"
    return "spawn" if autograd_threads_started() and _pickles(payload) else "fork"


def _pickles(obj) -> bool:
    """Whether ``spawn`` can send ``obj`` (its pickler: tensors go to shared memory, as they would)."""
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.dumps(obj)
    except Exception:  # noqa: BLE001 - any failure to pickle (local objects, locks, open files) means fork
        return False
    return True


def _run_processes(fn, world_size, args, kwargs, timeout, placement, start_method, time_limit=None):
    ctx = mp.get_context(_pick_start_method(start_method, (fn, args, kwargs, placement)))
    tmp = tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
    store_path = os.path.join(tmp, "store")
    procs, conns = [], []
    reaper = None
    beats = ctx.RawArray("d", world_size)  # each rank's latest progress() (time.monotonic, system-wide)
    with _signals_stop_ranks():
        try:
            reaper = _start_reaper(tmp)
            # a forked rank inherits the reapers' pipes and must close them; a spawned one does not
            inherited = 1 if ctx.get_start_method() == "fork" else None
            for r in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, name=rank_process_name(os.getpid(), r),
                                args=(r, world_size, store_path, child_end, fn, args, kwargs, timeout, placement,
                                      os.getpid(), inherited, beats))
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
            _stop_reaper(reaper)


def proc_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (R, S, T = stopped, Z = zombie, ...); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _stopped_ranks(procs, but: int | None = None) -> list[int]:
    """Ranks whose process is stopped (SIGSTOP, ^Z, a debugger): state T or t in /proc/<pid>/stat."""
    return [r for r, p in enumerate(procs) if r != but and proc_state(p.pid) in ("T", "t")]


def _blame_stopped(procs, world_size, r, what: str) -> None:
    """A stopped rank makes the others time out: name it instead of the rank that timed out."""
    stopped = _stopped_ranks(procs, but=r)
    if stopped:
        pids = ", ".join(f"rank {s}: pid {procs[s].pid}" for s in stopped)
        raise RankFailed(f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} of {world_size} "
                         f"stopped responding (process stopped by SIGSTOP or a debugger; {pids}); "
                         f"{what}")


def _how_died(p) -> str:
    code = p.exitcode
    if code is not None and code < 0 and -code in signal.valid_signals():
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


_CONNECTION_WORDS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe",
                     "Connection refused", "Timed out", "timed out")


def _is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in _CONNECTION_WORDS)


def _blame_dead(procs, world_size, r, what: str, wait_s: float = 2.0) -> None:
    """A rank killed outright makes its peers fail with gloo's "Connection closed by peer": when a
    peer of ``r`` has exited (within ``wait_s``) name it, not the rank that lost its connection."""
    end = time.monotonic() + wait_s
    while True:
        dead = [s for s, p in enumerate(procs) if s != r and p.exitcode not in (None, 0)]
        if dead or time.monotonic() >= end:
            break
        time.sleep(0.05)
    if dead:
        who = "; ".join(f"rank {s} of {world_size} died without reporting ({_how_died(procs[s])})" for s in dead)
        raise RankFailed(f"{who}; {what}")


def _reported_cause(pending, wait_s: float = 0.5):
    """A peer's error report already on its way that is not itself a lost connection: the cause of
    the connection errors its exit produced (it reported, then exited). ``(rank, (exc, tb))`` or None."""
    for c in mpc.wait(list(pending), timeout=wait_s):
        r = pending.pop(c)
        try:
            status, value = torch.load(io.BytesIO(c.recv_bytes()), weights_only=False)
        except (EOFError, OSError):
            continue
        if status == "error" and not _is_connection_error(value[0]):
            return r, value
    return None


def _stall_grace(timeout: float) -> float:
    """How long past the stall timeout the launcher waits before stopping the ranks itself, so that
    a collective that waited ``timeout`` in a rank reports first (naming the rank that did not
    answer): half the timeout, 30 s at most."""
    return min(30.0, 0.5 * timeout)


def _blame_stuck(procs, world_size, r, exc, pending, timeout) -> None:
    """Rank ``r`` timed out in a collective (gloo's "Timed out"): the ranks that do not report the
    same within a moment are the ones that stopped making progress; name them."""
    if not (isinstance(exc, RuntimeError) and ("Timed out" in str(exc) or "timed out" in str(exc))):
        return
    end = time.monotonic() + 2.0  # the ranks that were waiting too report the same timeout meanwhile
    while (quiet := [c for c in pending if not c.poll()]) and time.monotonic() < end:
        mpc.wait(quiet, timeout=max(0.0, end - time.monotonic()))
    stuck = sorted(r2 for c, r2 in pending.items() if not c.poll() and procs[r2].exitcode is None)
    if stuck:
        pids = ", ".join(f"rank {s}: pid {procs[s].pid}" for s in stuck)
        raise RankFailed(f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} of {world_size} made no "
                         f"progress for {timeout:g} s (the stall timeout, --timeout; {pids}); rank {r} timed out "
                         f"waiting for {'them' if len(stuck) > 1 else 'it'} in a collective")


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
        stall = timeout + _stall_grace(timeout)
        if now - last > stall:
            _blame_stopped(procs, world_size, None, f"no progress for {now - last:.0f} s")
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
                raise RankFailed(f"rank {r} of {world_size} died without reporting ({_how_died(procs[r])})") from None
            # our own forked child's report (exception objects included): trusted, not a file
            status, value = torch.load(io.BytesIO(data), weights_only=False)
            if status == "error":
                exc, tb = value
                then = f"rank {r} then failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                _blame_stopped(procs, world_size, r, then)
                _blame_stuck(procs, world_size, r, exc, pending, timeout)
                if _is_connection_error(exc):  # a peer that died makes the others lose their connections
                    cause = _reported_cause(pending)
                    if cause is not None:
                        _kill_all(procs)
                        r, (exc, tb) = cause
                        raise _name_rank(exc, r, world_size, tb)
                    _blame_dead(procs, world_size, r, then)
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
def comm_from_env(backend: str | None = None, timeout: float = 300.0, die_with_agent: bool | None = None):
    """A TorchComm for a process started by ``torchrun`` (env:// rendezvous: RANK, WORLD_SIZE, ...).

    ``backend`` defaults to NCCL when there is a CUDA device for every local rank (NCCL refuses two
    ranks on one GPU), gloo otherwise. ``die_with_agent`` (default:
    when torchrun's agent started us, ``TORCHELASTIC_RUN_ID`` set): this worker gets SIGKILL when its
    parent - the agent - dies (:func:`die_with_parent`), as ``run_local``'s ranks do, so a killed
    agent leaves no worker training on.
    """
    import torch.distributed as dist

    from .torchcomm import TorchComm

    if die_with_agent is None:
        die_with_agent = "TORCHELASTIC_RUN_ID" in os.environ
    if die_with_agent and not _WATCHING_PARENT:
        _watch_agent()
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


_WATCHING_PARENT: list[int] = []


def _watch_agent() -> None:
    die_with_parent()
    _WATCHING_PARENT.append(os.getppid())


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
    if not _is_connection_error(exc):
        return exc
    host = socket.gethostname()
    local = {r: pid for r, (h, pid) in enumerate(peers) if h == host and r != rank}
    end = time.monotonic() + 2.0
    gone = []
    while not gone and time.monotonic() < end:
        gone = [r for r, pid in local.items() if not _process_alive(pid)]
        if not gone:
            time.sleep(0.1)
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    if gone:
        what = ", ".join(f"rank {r} (pid {local[r]} on {host})" for r in gone)
        return RankFailed(f"rank {rank}: lost {what}: its process is gone; gloo said: {first}")
    remote = sorted(r for r, (h, _) in enumerate(peers) if h != host)
    where = f"one of ranks {remote} on other hosts" if remote else "a peer whose process is still alive"
    return RankFailed(f"rank {rank}: lost the connection to {where}; gloo said: {first}")


def _process_alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    return proc_state(pid) not in (None, "Z", "X")


def torchrun_main(fn: Callable, *args, backend: str | None = None, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` in this torchrun worker; returns this rank's result."""
    import torch.distributed as dist

    comm = comm_from_env(backend)
    try:
        return fn(comm, *args, **kwargs)
    finally:
        dist.barrier()
        dist.destroy_process_group()
