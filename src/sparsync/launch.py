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
  :func:`on_orphan` callbacks, e.g. the cluster's namespace deletion) when the launcher dies even
  by SIGKILL. Rank processes are named ``ss<launcher pid>r<rank>`` and stores
  ``sparsync-store-<launcher pid>-*`` so ``sparsync cluster cleanup`` finds leftovers of dead
  launchers (only ours).
* A rank that is stopped (SIGSTOP, a debugger) is named as the culprit when the others time out.
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
           "rank_process_name", "peer_table", "lost_peer_error"]

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
              start_method: str | None = None, **kwargs) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` ranks; return results in rank order.

    ``backend="gloo"``: one process per rank (``start_method``: see :func:`_pick_start_method`),
    ``comm`` a CPU :class:`~sparsync.torchcomm.TorchComm`; ranks that work on a GPU wrap the same
    group as ``TorchComm(device="cuda")``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend == "thread":
        check_thread_world_size(world_size)  # the one limit of the thread cluster, MAX_THREAD_RANKS
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


# ---------------------------------------------------------------------- orphans
_ORPHAN_CALLBACKS: list[Callable[[], object]] = []
_libc = None


def on_orphan(fn: Callable[[], object]) -> Callable[[], None]:
    """Register ``fn()`` for the reaper: it runs when a launcher dies without cleaning up (SIGKILL).

    The reaper of a ``run_local`` call is forked when the call starts, with a copy of the callbacks
    registered by then (an EmulatedCluster registers the deletion of its namespaces). Returns a
    function that unregisters ``fn``.
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


def _die_with_parent(parent_pid: int, rank: int, reaper_fd: int | None) -> None:
    """In a fresh rank process: get SIGKILL when the launcher dies, default signal dispositions.

    SIGTERM kills the rank; SIGINT is ignored (a terminal's Ctrl-C reaches the whole process group:
    the launcher decides, and kills the ranks). PR_SET_PDEATHSIG fires when the thread that forked
    us ends; that thread waits in ``_collect`` for as long as ranks run.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if reaper_fd is not None:
        with contextlib.suppress(OSError):
            os.close(reaper_fd)  # only the launcher may hold the reaper's pipe open
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


def _start_reaper(store_dir: str) -> tuple[int, int] | None:
    """Fork a reaper that, if the launcher dies without writing ``done`` to its pipe, removes the
    store directory and runs the :func:`on_orphan` callbacks. Returns (pid, pipe write end)."""
    if not hasattr(os, "fork"):
        return None
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the reaper only reads
        pid = os.fork()
    if pid:
        os.close(r)
        return pid, w
    try:  # the reaper
        os.close(w)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # it must outlive the launcher to clean up after it
        _prctl(_PR_SET_NAME, b"sparsync-reaper")
        said = b""
        while chunk := os.read(r, 64):
            said += chunk
        if b"done" not in said:
            time.sleep(0.1)  # the ranks get SIGKILL from the kernel; let them go first
            for fn in list(_ORPHAN_CALLBACKS):
                with contextlib.suppress(BaseException):
                    fn()
            shutil.rmtree(store_dir, ignore_errors=True)
    finally:
        os._exit(0)


def _stop_reaper(reaper) -> None:
    if reaper is None:
        return
    pid, w = reaper
    with contextlib.suppress(OSError):
        os.write(w, b"done")
    with contextlib.suppress(OSError):
        os.close(w)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


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
def _child(rank, world_size, store_path, conn, fn, args, kwargs, timeout, placement, parent_pid, reaper_fd):
    import torch.distributed as dist

    from .torchcomm import TorchComm

    status = "ok"
    try:
        _die_with_parent(parent_pid, rank, reaper_fd)
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


def _pick_start_method(requested):
    """``fork`` (fast; ``fn`` need not pickle) unless CUDA is initialised here: a forked child cannot
    use it then, so ``spawn``. Only torch's flag is read: ``torch.cuda.is_available()`` asks the
    driver, after which no forked child can use CUDA either (torch refuses: "Cannot re-initialize
    CUDA in forked subprocess") - a caller that did so and whose ranks use CUDA passes
    ``start_method="spawn"``, or sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` before asking."""
    if requested:
        return requested
    return "spawn" if torch.cuda.is_initialized() else "fork"


def _run_processes(fn, world_size, args, kwargs, timeout, placement, start_method):
    ctx = mp.get_context(_pick_start_method(start_method))
    tmp = tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
    store_path = os.path.join(tmp, "store")
    procs, conns = [], []
    reaper = None
    with _signals_stop_ranks():
        try:
            reaper = _start_reaper(tmp)
            # a forked rank inherits the reaper's pipe and must close it; a spawned one does not
            inherited = reaper[1] if reaper and ctx.get_start_method() == "fork" else None
            for r in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, name=rank_process_name(os.getpid(), r),
                                args=(r, world_size, store_path, child_end, fn, args, kwargs, timeout, placement,
                                      os.getpid(), inherited))
                p.daemon = True
                p.start()
                child_end.close()
                procs.append(p)
                conns.append(parent_end)
            return _collect(procs, conns, world_size, timeout + 30.0)
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


def _collect(procs, conns, world_size, deadline_s):
    results: list[Any] = [None] * world_size
    pending = {c: r for r, c in enumerate(conns)}
    deadline = time.monotonic() + deadline_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(pending.values())
            _blame_stopped(procs, world_size, None, f"ranks {missing} did not finish within {deadline_s:.0f}s")
            raise RankFailed(f"ranks {missing} of {world_size} did not finish within {deadline_s:.0f}s")
        ready = mpc.wait(list(pending), timeout=min(left, 1.0))
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
