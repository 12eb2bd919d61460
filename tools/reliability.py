"""Try fault and bad-input cases and write the table of docs/reliability.md.

``python tools/reliability.py [--out docs/reliability.md]`` runs every case below for real (real
gloo processes, real signals, real files; the thread backend where a case is about the reducers'
arithmetic) and classifies what happened:

* **clean error** - the expected exception / exit code, one line naming the problem (and the rank);
* **recovers** - the fault is survived: nothing is left behind, a resume is bitwise;
* **silent wrong** - no error although the input or state was bad;
* **hang** - no answer within the case's time limit.

The table between the ``<!-- table -->`` markers of the output file is replaced; the rest of the
file (the prose, the elastic-restart recipe) is kept. Cases that need root (emulated network, a
read-only mount) are marked "not tried" elsewhere. ``--cost`` measures the non-finite check of
``Reducer.reduce`` at n = 1e7 instead (the ``<!-- cost -->`` section).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from sparsync.tables import format_table

CASES: list = []


def case(kind: str, what: str, limit: float = 120.0):
    def deco(fn):
        CASES.append((kind, what, limit, fn))
        return fn

    return deco


class Outcome(Exception):
    def __init__(self, outcome: str, detail: str):
        super().__init__(outcome, detail)
        self.outcome, self.detail = outcome, detail


def _expect_error(fn, exc_type, pattern: str) -> tuple[str, str]:
    try:
        fn()
    except exc_type as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if re.search(pattern, str(e)):
            return "clean error", f"{type(e).__name__}: {msg}"
        return "unclear error", f"{type(e).__name__}: {msg}"
    return "silent wrong", "no error"


def _thread(fn, *args, P=4):
    from sparsync.launch import run_local

    return run_local(fn, P, *args, backend="thread", timeout=30)


# ---------------------------------------------------------------------- bad input
@case("bad input", "NaN, +Inf, -Inf in the gradient of every registered reducer (used directly)")
def _nonfinite_all():
    from sparsync.reducers.registry import load_all, make_reducer

    bad_cases, total = [], 0
    for name in sorted(load_all()):
        for bad in (float("nan"), float("inf"), -float("inf")):
            total += 1

            def w(comm, name=name, bad=bad):
                r = make_reducer(name, comm, 0.05)
                g = torch.randn(4096)
                if comm.rank == 1:
                    g[3] = bad
                return r.reduce(g)

            out = _expect_error(lambda w=w: _thread(w), FloatingPointError, r"rank 1: .*non-finite")
            if out[0] != "clean error":
                bad_cases.append(f"{name}/{bad}: {out[0]}")
    if bad_cases:
        return "silent wrong", "; ".join(bad_cases)
    return "clean error", (f"all {len(load_all())} reducers x 3 values: FloatingPointError 'rank 1: "
                           "<reducer>.reduce got a non-finite gradient at step 0 ...'")


@case("bad input", "NaN gradient under SparseDDP (default nonfinite='error')")
def _nonfinite_ddp():
    from torch import nn

    from sparsync.ddp import SparseDDP

    with torch.random.fork_rng(devices=[]):  # one seeded model for every rank; the caller's RNG restored
        torch.manual_seed(0)
        model = nn.Linear(8, 2)

    def w(comm):
        m = copy.deepcopy(model)
        d = SparseDDP(m, comm, reducer="micro", density=0.5)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(comm.rank))
        if comm.rank == 2:
            x[0, 0] = float("nan")
        d(x).sum().backward()

    return _expect_error(lambda: _thread(w), FloatingPointError, r"non-finite")


@case("bad input", "spardl.reduce(torch.zeros(0))")
def _empty():
    from sparsync.reducers.registry import make_reducer

    return _expect_error(lambda: _thread(lambda c: make_reducer("spardl", c, 0.05).reduce(torch.zeros(0))),
                         ValueError, "non-empty gradient")


@case("bad input", "ranks pass different dtypes (float32 / float64)")
def _dtypes():
    from sparsync.reducers.registry import make_reducer

    def w(c):
        return make_reducer("micro", c, 0.05).reduce(torch.randn(256, dtype=torch.float64 if c.rank else torch.float32))

    return _expect_error(lambda: _thread(w, P=2), ValueError, "dtype differs across ranks")


@case("bad input", "ranks use different densities")
def _densities():
    from sparsync.reducers.registry import make_reducer

    return _expect_error(lambda: _thread(lambda c: make_reducer("spardl", c, 0.05 * (1 + c.rank)).reduce(
        torch.randn(256)), P=2), ValueError, "density differs across ranks")


@case("bad input", "ranks pass different gradient sizes")
def _numels():
    from sparsync.reducers.registry import make_reducer

    return _expect_error(lambda: _thread(lambda c: make_reducer("s2", c, 0.05).reduce(torch.randn(256 + c.rank)),
                                         P=2), ValueError, "numel differs across ranks")


@case("bad input", "SparseVec(numel=2.7)")
def _sparsevec():
    from sparsync.sparse import SparseVec

    return _expect_error(lambda: SparseVec(torch.tensor([0]), torch.tensor([1.0]), 2.7), TypeError, "integer")


def _cli(argv: list[str]) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "sparsync.cli", *argv], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr.strip()


def _cli_case(argv, code, pattern):
    rc, err = _cli(argv)
    lines = err.splitlines()
    last = lines[-1] if lines else ""
    if rc == code and len(lines) == 1 and re.search(pattern, last):
        return "clean error", f"exit {rc}: {last}"
    return ("silent wrong" if rc == 0 else "unclear error"), f"exit {rc}: {err[-300:]}"


_SMALL = ["--thread", "--workload", "digits-mlp", "--workload-option", "width=16", "--workers", "2",
          "--reducer", "micro", "--no-progress"]


@case("bad input", "`sparsync train --batch-size 0`")
def _batch0():
    return _cli_case(["train", *_SMALL, "--steps", "2", "--batch-size", "0", "--runs-dir", _TMP, "--name", "b0"],
                     2, "batch-size.*positive integer")


@case("bad input", "`--runs-dir` is a file")
def _runs_dir_file():
    f = Path(_TMP) / "a-file"
    f.write_text("x")
    return _cli_case(["train", *_SMALL, "--steps", "2", "--runs-dir", str(f), "--name", "x"], 2,
                     "Not a directory|not a directory")


@contextlib.contextmanager
def tmpfs(path, options: str = "size=64k"):
    """A tmpfs mounted at ``path`` (created) with ``options`` for the block (root only), unmounted after."""
    path = Path(path)
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@case("bad input", "`--runs-dir` on a read-only filesystem")
def _runs_dir_ro():
    if os.geteuid() != 0:
        return "not tried", "needs root to mount a read-only tmpfs"
    with tmpfs(Path(_TMP) / "ro", "ro,size=64k") as d:
        return _cli_case(["train", *_SMALL, "--steps", "2", "--runs-dir", str(d), "--name", "x"], 2,
                         "Read-only file system")


def _train_cfg(name, steps=4, **kw):
    from sparsync.train.loop import validate
    from sparsync.train.runs import TrainConfig

    d = dict(workload="digits-mlp", workload_options={"width": 16}, reducer="micro", density=0.05, workers=2,
             steps=steps, eval_every=2, runs_dir=_TMP, name=name, network="thread", progress=False, timeout=60)
    d.update(kw)
    cfg = TrainConfig(**d)
    validate(cfg)
    return cfg


@case("bad input", "`--resume` from a checkpoint whose pickle runs os.system")
def _evil():
    from sparsync.train.loop import launch
    from sparsync.train.runs import CheckpointError

    launch(_train_cfg("evil", 2))
    ck = Path(_TMP) / "evil" / "checkpoints" / "step_000002" / "rank0.pt"
    marker = Path(_TMP) / "pwned"
    blob = torch.load(ck, weights_only=True)
    blob["loop"] = _Evil(str(marker))
    torch.save(blob, ck)
    out = _expect_error(lambda: launch(_train_cfg("evil", 4), resume=True), CheckpointError, "could run code")
    if marker.exists():
        return "silent wrong", "the payload ran"
    return out[0], out[1][:160] + " (payload not run)"


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@case("bad input", "`--resume` from a truncated / garbage checkpoint file")
def _corrupt():
    from sparsync.train.loop import launch
    from sparsync.train.runs import CheckpointError

    launch(_train_cfg("corrupt", 2))
    (Path(_TMP) / "corrupt" / "checkpoints" / "step_000002" / "rank1.pt").write_bytes(b"PK\x03\x04garbage")
    return _expect_error(lambda: launch(_train_cfg("corrupt", 4), resume=True), CheckpointError, "corrupt")


# ---------------------------------------------------------------------- disk
@case("disk", "disk full (ENOSPC) while rank 1 saves a checkpoint")
def _enospc():
    from sparsync.train import runs as R
    from sparsync.train.loop import launch

    real = torch.save

    def save(obj, f, *a, **k):
        if "step_000004" in str(f) and "rank1" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real(obj, f, *a, **k)

    R.torch.save = save
    try:
        out = _expect_error(lambda: launch(_train_cfg("full", 6, checkpoint_every=2)), R.CheckpointError,
                            r"rank 1: could not write checkpoint .*No space left")
    finally:
        R.torch.save = real
    rd = R.RunDir(Path(_TMP) / "full")
    if out[0] == "clean error" and (rd.latest_step() != 2 or rd.checkpoint_steps() != [2]):
        return "silent wrong", f"latest {rd.latest_step()}, on disk {rd.checkpoint_steps()}"
    launch(_train_cfg("full", 6, checkpoint_every=2), resume=True)
    return out[0], out[1][:140] + "...; latest stays 2, resume completes"


@case("disk", "checkpoint every 2 steps for 12 steps (pruning), temp files of a killed save")
def _prune():
    from sparsync.train.loop import launch
    from sparsync.train.runs import RunDir

    launch(_train_cfg("prune", 12, checkpoint_every=2))
    rd = RunDir(Path(_TMP) / "prune")
    (rd.ckpt_dir(12) / "rank0.tmp4242").write_bytes(b"x")
    (rd.path / "checkpoints" / "latest").write_text("10\n")
    launch(_train_cfg("prune", 12, checkpoint_every=2), resume=True)
    tmp = glob.glob(str(rd.path / "**" / "*.tmp*"), recursive=True)
    if rd.checkpoint_steps() == [10, 12] and not tmp:
        return "recovers", "2 newest kept (default --keep-checkpoints 2); temp file and unfinished step removed"
    return "silent wrong", f"on disk {rd.checkpoint_steps()}, temp {tmp}"


# ---------------------------------------------------------------------- processes
def _wait_for_lines(metrics: Path, p: subprocess.Popen, lines: int, limit: float = 240) -> None:
    """Until the run's ``metrics.jsonl`` has ``lines`` lines (the run is training), ``p`` ended, or ``limit`` s."""
    end = time.monotonic() + limit
    while time.monotonic() < end and p.poll() is None:
        with contextlib.suppress(OSError):
            if len(metrics.read_text().splitlines()) >= lines:
                return
        time.sleep(0.02)


def _launch_and_kill(name, victim, sig=signal.SIGKILL, extra=()):
    metrics = Path(_TMP) / name / "metrics.jsonl"
    cmd = [sys.executable, "-m", "sparsync.cli", "train", "--workload", "digits-mlp", "--workload-option",
           "width=16", "--reducer", "micro", "--workers", "2", "--steps", "100000", "--eval-every", "100000",
           "--runs-dir", _TMP, "--name", name, "--no-progress", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_lines(metrics, p, 2)
    ranks = rank_pids(p.pid)
    below = descendants(p.pid)
    os.kill(p.pid if victim == "launcher" else ranks[victim], sig)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        return "hang", "launcher did not end within 60 s"
    t0 = time.monotonic()
    left = wait_clean(p.pid, below, 5.0)
    return p.returncode, err.strip(), left, time.monotonic() - t0


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of a launcher's live rank processes (named ``ss<launcher pid>r<rank>``)."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            m = re.fullmatch(rf"ss{launcher_pid}r(\d+)", Path(f"/proc/{d}/comm").read_text().strip())
            if m and alive(int(d)):
                out[int(m.group(1))] = int(d)
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...)."""
    kids: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            kids.setdefault(int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """Exists and is not a zombie (a zombie runs nothing and holds nothing)."""
    from sparsync.launch import proc_state

    return proc_state(pid) not in (None, "Z", "X")


def leftovers(launcher_pid: int, pids) -> dict:
    """What a launcher left: live processes among ``pids``, its stores, its namespaces (empty lists: nothing)."""
    from sparsync.cluster import PREFIX, list_namespaces
    from sparsync.launch import STORE_PREFIX

    return {"processes": [p for p in pids if alive(p)],
            "stores": glob.glob(os.path.join(tempfile.gettempdir(), f"{STORE_PREFIX}{launcher_pid}-*")),
            "namespaces": [n for n in list_namespaces() if n.startswith(f"{PREFIX}{launcher_pid}s")]}


def wait_clean(launcher_pid: int, pids, timeout: float = 5.0) -> dict:
    """Poll until nothing is left ({}) or ``timeout`` passes (then what is left)."""
    end = time.monotonic() + timeout
    while True:
        left = {k: v for k, v in leftovers(launcher_pid, pids).items() if v}
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def _kill_case(name, victim, sig=signal.SIGKILL, extra=()):
    res = _launch_and_kill(name, victim, sig, extra)
    if isinstance(res[0], str):
        return res
    rc, err, left, took = res
    if left:
        return "silent wrong", f"left after 5 s: {left}"
    last = err.splitlines()[-1] if err else ""
    if victim == "launcher":
        return "recovers", (f"launcher exit {rc}; every rank, the reaper and the store gone {took:.1f} s after "
                            "the launcher ended")
    if rc == 1 and f"rank {victim}" in last and "Traceback" not in err:
        return "clean error", f"exit 1: {last}; nothing left {took:.1f} s after the launcher ended"
    return "unclear error", f"exit {rc}: {err[-300:]}"


@case("process", "kill -9 of rank 1 (loopback)", limit=300)
def _kill_rank():
    return _kill_case("kr", 1)


@case("process", "kill -9 of the launcher (loopback)", limit=300)
def _kill_launcher():
    return _kill_case("kl", "launcher")


@case("process", "SIGTERM to the launcher (loopback)", limit=300)
def _term_launcher():
    return _kill_case("tl", "launcher", signal.SIGTERM)


@case("process", "kill -9 of the launcher on the emulated 1 Gbit/s network", limit=300)
def _kill_launcher_netns():
    from sparsync.cluster import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        return "not tried", reason
    out = _kill_case("kln", "launcher", extra=("--bandwidth", "1gbit"))
    return out[0], out[1] + " (namespaces included)" if out[0] == "recovers" else out[1]


def _stop_worker(comm):
    import time as _t

    for i in range(10_000):
        if comm.rank == 1 and i == 20:
            os.kill(os.getpid(), signal.SIGSTOP)
        comm.allreduce(torch.ones(8))
        _t.sleep(0.001)


@case("process", "SIGSTOP of rank 1 (the others time out)", limit=120)
def _sigstop():
    from sparsync.launch import RankFailed, run_local

    return _expect_error(lambda: run_local(_stop_worker, 3, backend="gloo", timeout=5), RankFailed,
                         r"rank 1 of 3 stopped responding")


# ---------------------------------------------------------------------- run directories
def _main(argv: list[str]) -> tuple[int, str]:
    """``sparsync.cli.main`` in this process (no interpreter start-up): exit code and stderr."""
    import io

    from sparsync.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue().strip()


def _main_case(argv, code, pattern, left=None):
    """One command in this process: "clean error" when it exits ``code`` with one line matching
    ``pattern`` and ``left()`` (what must not have happened) says nothing."""
    rc, err = _main(argv)
    lines = err.splitlines()
    last = lines[-1] if lines else ""
    harm = left() if left else None
    if harm:
        return "silent wrong", f"exit {rc}: {harm}"
    if rc == code and len(lines) == 1 and re.search(pattern, last):
        return "clean error", f"exit {rc}: {last}"
    return ("silent wrong" if rc == 0 else "unclear error"), f"exit {rc}: {err[-300:]}"


_COMPARE = ["compare", "--thread", "--workload", "digits-mlp", "--workload-option", "width=16", "--workers", "2",
            "--configs", "micro:0.05", "--no-baselines", "--no-progress", "--steps", "2"]


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@case("run dir", "`--name ../victim`, `/abs/path`, `''`, `.`, with and without `--force`, in `train` and `compare`")
def _names():
    victim, runs = Path(_TMP) / "victim", Path(_TMP) / "names"
    victim.mkdir(exist_ok=True)
    (victim / "precious").write_text("x")
    _main(["train", *_SMALL, "--steps", "2", "--runs-dir", str(runs), "--name", "other"])
    before, outs = (_tree(victim), _tree(runs)), []
    for name in ("../victim", str(victim), "", "."):
        for force in ([], ["--force"]):
            for cmd in (["train", *_SMALL, "--steps", "2"], _COMPARE):
                outs.append(_main([*cmd, "--runs-dir", str(runs), "--name", name, *force]))
    if (_tree(victim), _tree(runs)) != before:
        return "silent wrong", "something was deleted or created"
    if all(rc == 2 and len(e.splitlines()) == 1 and "single directory name" in e for rc, e in outs):
        return "clean error", f"{len(outs)} commands, each exit 2: {outs[0][1]}; nothing deleted or created"
    return "unclear error", "; ".join(f"exit {rc}: {e[-120:]}" for rc, e in outs if rc != 2)[:300]


@case("run dir", "`--force` on a directory that is not a sparsync run (`train`, `compare`)")
def _force_foreign():
    runs = Path(_TMP) / "foreign"
    mine = runs / "mine"
    mine.mkdir(parents=True, exist_ok=True)
    (mine / "notes.txt").write_text("mine")
    out = _main_case(["train", *_SMALL, "--steps", "2", "--runs-dir", str(runs), "--name", "mine", "--force"], 2,
                     r"is not a sparsync run directory \(no marker file\); --force deletes only those",
                     lambda: None if (mine / "notes.txt").exists() else "the directory was deleted")
    out2 = _main_case([*_COMPARE, "--runs-dir", str(runs), "--name", "mine", "--force"], 2,
                      r"is not a sparsync comparison directory",
                      lambda: None if (mine / "notes.txt").exists() else "the directory was deleted")
    return out if out[0] != "clean error" else out2[0], out[1] + " (compare: the same)"


@case("run dir", "`--force` and a second `--resume` while a run is live (loopback)", limit=300)
def _live():
    from sparsync.train.runs import RunDir

    metrics = Path(_TMP) / "live" / "metrics.jsonl"
    cmd = [sys.executable, "-m", "sparsync.cli", "train", "--workload", "digits-mlp", "--workload-option", "width=16",
           "--reducer", "micro", "--workers", "2", "--steps", "100000", "--eval-every", "100000", "--runs-dir", _TMP,
           "--name", "live", "--no-progress"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 240
        while p.poll() is None and time.monotonic() < end:
            with contextlib.suppress(OSError):
                if len(metrics.read_text().splitlines()) >= 4:
                    break
            time.sleep(0.05)
        outs = [_main([*cmd[3:], *extra]) for extra in (["--force"], ["--resume"])]
        alive_after = p.poll() is None
    finally:
        p.kill()
        p.communicate()
    steps = [m["step"] for m in RunDir(Path(_TMP) / "live").metrics()]
    if not alive_after or steps != list(range(len(steps))):
        return "silent wrong", f"live run alive: {alive_after}; its steps in order: {steps == list(range(len(steps)))}"
    want = f"is in use by another sparsync process (pid {p.pid})"
    if all(rc == 2 and len(e.splitlines()) == 1 and want in e for rc, e in outs):
        return "clean error", f"both exit 2: {outs[0][1]}; the live run goes on"
    return "unclear error", "; ".join(f"exit {rc}: {e[-150:]}" for rc, e in outs)


@case("run dir", "`--resume --steps 4` of a finished 8-step run (checkpoints every 4)")
def _resume_fewer():
    from sparsync.train.runs import RunDir

    base = ["train", *_SMALL, "--checkpoint-every", "4", "--runs-dir", _TMP, "--name", "fewer"]
    _main([*base, "--steps", "8"])
    rd = RunDir(Path(_TMP) / "fewer")
    return _main_case([*base, "--steps", "4", "--resume"], 2, r"already holds step 8; pass --steps 8 or more",
                      lambda: None if rd.latest_step() == 8 and (rd.ckpt_dir(8) / "rank1.pt").exists()
                      and rd.checkpoint_steps() == [4, 8] else f"checkpoints now {rd.checkpoint_steps()}")


@case("run dir", "`compare --force` while another `compare` writes its report (same directory)")
def _compare_race():
    from sparsync.train import report

    runs, real, raced = Path(_TMP) / "race", report.write_report, []

    def racing(*a, **k):  # the second invocation arrives while the first writes its report
        raced.append(_main([*_COMPARE, "--runs-dir", str(runs), "--name", "c", "--force"]))
        return real(*a, **k)

    report.write_report = racing
    try:
        rc, err = _main([*_COMPARE, "--runs-dir", str(runs), "--name", "c"])
    finally:
        report.write_report = real
    if rc != 0 or not (runs / "c" / "comparison.json").exists():
        return "silent wrong" if rc == 0 else "unclear error", f"the first compare: exit {rc}: {err[-200:]}"
    rc2, err2 = raced[0]
    if rc2 == 2 and len(err2.splitlines()) == 1 and "is in use by another sparsync process" in err2:
        return "clean error", f"exit 2: {err2}; the first writes its report and data whole"
    return ("silent wrong" if rc2 == 0 else "unclear error"), f"the racing --force: exit {rc2}: {err2[-200:]}"


@case("disk", "torn last line of metrics.jsonl (a cut-short write), then `--resume`")
def _torn():
    from sparsync.train.runs import read_metrics

    base = ["train", *_SMALL, "--checkpoint-every", "2", "--runs-dir", _TMP, "--name", "torn"]
    _main([*base, "--steps", "4"])
    mf = Path(_TMP) / "torn" / "metrics.jsonl"
    with open(mf, "a") as f:
        f.write('{"step": 4, "loss": 0.1')
    rc, err = _main([*base, "--steps", "6", "--resume"])
    steps = [m["step"] for m in read_metrics(mf)]
    if rc == 0 and steps == list(range(6)) and f"{mf}: ignoring its torn last line" in err:
        return "recovers", "warning names the file and drops the torn line; resume completes, steps 0-5 once each"
    return "unclear error", f"exit {rc}: {err[-200:]}; steps {steps}"


@case("disk", "disk full while rank 0 appends metrics (64 KiB tmpfs)")
def _metrics_enospc():
    if os.geteuid() != 0:
        return "not tried", "needs root to mount a small tmpfs"
    with tmpfs(Path(_TMP) / "small") as d:
        return _main_case(["train", *_SMALL, "--steps", "100000", "--eval-every", "100000", "--runs-dir", str(d),
                           "--name", "x"], 2, rf"No space left on device \(writing the metrics file\): {d}/x/metrics")


@contextlib.contextmanager
def _full_disk(cls, method: str, hit):
    """``cls.method`` raises ENOSPC naming no file (as a write on a full disk does) where ``hit(path)``,
    after writing a few bytes there (a torn file); put back after the block."""
    real = getattr(cls, method)

    def writer(self, *a, **k):
        path = self if cls is Path else Path(a[0])
        if hit(path):
            with open(path, "wb") as f:
                f.write(b"torn")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *a, **k)

    setattr(cls, method, writer)
    try:
        yield
    finally:
        setattr(cls, method, real)


@case("disk", "disk full (ENOSPC) at each of a new run directory's first files (marker, config, metrics)")
def _start_enospc():
    runs, outs = Path(_TMP) / "start-full", []
    for name in (".sparsync-run", "config.json", "metrics.jsonl"):
        with _full_disk(Path, "write_text", lambda p, name=name: p.name.startswith(name)):
            outs.append(_main_case(["train", *_SMALL, "--steps", "2", "--runs-dir", str(runs), "--name", "r"], 2,
                                   rf"No space left on device: .*/r/{re.escape(name)}$",
                                   lambda: "the run directory (and its .lock) was left" if (runs / "r").exists()
                                   else None))
    bad = [o for o in outs if o[0] != "clean error"]
    if bad:
        return bad[0]
    return "clean error", f"3 files, each {outs[0][1]}; no directory and no .lock left"


@case("disk", "disk already full when a run starts (a full 4 KiB tmpfs; the pid in `<run>/.lock` is the first write)")
def _full_at_start():
    if os.geteuid() != 0:
        return "not tried", "needs root to mount a small tmpfs"
    with tmpfs(Path(_TMP) / "full-at-start", "size=4k") as d:
        with open(d / "fill", "wb", buffering=0) as f:  # every later write gets ENOSPC
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 1024)
        return _main_case(["train", *_SMALL, "--steps", "2", "--runs-dir", str(d / "runs"), "--name", "r"], 2,
                          r"No space left on device: .*/runs/r/\.lock$",
                          lambda: "the run directory (and its .lock) was left" if (d / "runs" / "r").exists() else None)


@case("disk", "disk full (ENOSPC) while `compare` writes its plots, then while it rewrites its report")
def _report_enospc():
    from matplotlib.figure import Figure

    runs = Path(_TMP) / "report-full"
    root = runs / "c"
    argv = [*_COMPARE, "--runs-dir", str(runs), "--name", "c"]
    report = {"report.md", "comparison.csv", "comparison.json", "accuracy_vs_time.png", "time_to_target.png"}
    with _full_disk(Figure, "savefig", lambda p: p.name == "time_to_target.png"):
        first = _main_case(argv, 2, r"No space left on device: .*/c/time_to_target\.png$",
                           lambda: "a partial report was left" if any(p.name in report or ".tmp" in p.name
                                                                      for p in root.iterdir()) else None)
    if first[0] != "clean error":
        return first
    rc, err = _main([*argv, "--resume"])
    before = {p.name: p.read_bytes() for p in root.iterdir() if p.name in report}
    if rc != 0 or set(before) != report:
        return "unclear error", f"the resumed compare: exit {rc}: {err[-200:]}"
    with _full_disk(Path, "write_text", lambda p: p.name == "report.md"):
        second = _main_case([*argv, "--resume"], 2, r"No space left on device: .*/c/report\.md$",
                            lambda: "the previous report set changed" if before != {
                                p.name: p.read_bytes() for p in root.iterdir() if p.name in report} else None)
    if second[0] != "clean error":
        return second
    return "clean error", f"{first[1]}; no plot left; a later failure keeps the previous report set whole"


# ---------------------------------------------------------------------- limits and processes
def _beating(comm, steps):
    from sparsync.launch import progress

    for _ in range(steps):
        comm.allreduce(torch.ones(8))
        progress()
        time.sleep(0.02)
    return steps


def _stuck(comm):
    from sparsync.launch import progress

    for i in range(1_000_000):
        if comm.rank == 1 and i == 5:
            time.sleep(3600)
        comm.allreduce(torch.ones(8))
        progress()


@case("process", "stall timeout 2 s: a run that keeps progressing for 8 s")
def _stall_progress():
    from sparsync.launch import run_local

    t0 = time.monotonic()
    try:
        run_local(_beating, 2, 400, backend="gloo", timeout=2.0)
    except Exception as e:  # noqa: BLE001
        return "silent wrong", f"stopped although progressing: {type(e).__name__}: {str(e)[:150]}"
    return "recovers", f"completed in {time.monotonic() - t0:.1f} s (--timeout counts no progressing time)"


@case("process", "stall timeout 2 s: rank 1 stops making progress")
def _stall_stuck():
    from sparsync.launch import RankFailed, run_local

    t0 = time.monotonic()
    out = _expect_error(lambda: run_local(_stuck, 2, backend="gloo", timeout=2.0), RankFailed,
                        r"rank 1 of 2 made no progress for 2 s \(the stall timeout")
    return out[0], out[1] + f" (after {time.monotonic() - t0:.1f} s)"


@case("process", "`--workers 300`, `--workers 1e12` (loopback)")
def _many_workers():
    runs = Path(_TMP) / "many"
    stores = set(glob.glob(os.path.join(tempfile.gettempdir(), "sparsync-store-*")))
    outs = [_main(["train", "--workload", "digits-mlp", "--workers", w, "--steps", "2", "--no-progress",
                   "--runs-dir", str(runs)]) for w in ("300", "1e12")]
    leaked = set(glob.glob(os.path.join(tempfile.gettempdir(), "sparsync-store-*"))) - stores
    if runs.exists() or leaked:
        return "silent wrong", f"created {runs.exists()}, stores leaked {sorted(leaked)}"
    if all(rc == 2 and len(e.splitlines()) == 1 and "local ranks fit here" in e for rc, e in outs):
        return "clean error", f"exit 2: {outs[0][1]}; nothing forked or created"
    return "unclear error", "; ".join(f"exit {rc}: {e[-150:]}" for rc, e in outs)


@case("process", "kill -9 while the emulated cluster is being built (8 ranks)", limit=180)
def _kill_build():
    from sparsync.cluster import PREFIX, _delete_namespaces, list_namespaces, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        return "not tried", reason
    code = "import time; from sparsync.cluster import EmulatedCluster; EmulatedCluster(8, bandwidth='1gbit').start()"
    p = subprocess.Popen([sys.executable, "-c", code + "; time.sleep(60)"])
    mine = f"{PREFIX}{p.pid}s"
    try:
        end = time.monotonic() + 120
        while not any(n.startswith(mine) for n in list_namespaces()):
            if p.poll() is not None or time.monotonic() > end:
                return "unclear error", "the build never started"
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        t0 = time.monotonic()
        while (left := [n for n in list_namespaces() if n.startswith(mine)]) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
    finally:
        if p.poll() is None:
            p.kill()
    if left:
        _delete_namespaces(left)
        return "silent wrong", f"{len(left)} namespaces left after 10 s"
    return "recovers", f"killed at the first namespace; none left {time.monotonic() - t0:.1f} s later"


def _torchrun(*args, name, max_restarts=0):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--nproc-per-node", "2", "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "sparsync.cli", "train",
            "--workload", "digits-mlp", "--workload-option", "width=16", "--reducer", "micro", "--no-progress",
            "--runs-dir", _TMP, "--name", name, *args]


@case("process", "kill -9 of the torchrun agent (2 workers)", limit=300)
def _kill_agent():
    metrics = Path(_TMP) / "agent" / "metrics.jsonl"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.Popen(_torchrun("--steps", "100000", "--eval-every", "100000", name="agent"), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_lines(metrics, p, 4)
    workers = [q for q in descendants(p.pid) if _env_has(q, b"RANK=")]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t0 = time.monotonic()
    while any(alive(q) for q in workers) and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    left = [q for q in workers if alive(q)]
    for q in left:
        os.kill(q, signal.SIGKILL)
    if left or len(workers) != 2:
        return "silent wrong", f"workers {workers}, alive 5 s after the agent died: {left}"
    return "recovers", f"both workers gone {time.monotonic() - t0:.2f} s after the agent died (parent-death watch)"


def _env_has(pid: int, prefix: bytes) -> bool:
    try:
        return any(kv.startswith(prefix) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return False


@case("process", "torchrun `--max-restarts 1` on an existing run without `--force`", limit=300)
def _restart_refusal():
    from sparsync.train.runs import is_run

    _main(["train", *_SMALL, "--steps", "2", "--runs-dir", _TMP, "--name", "taken"])
    target = Path(_TMP) / "taken"
    before = _tree(target)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    p = subprocess.run(_torchrun("--steps", "4", name="taken", max_restarts=1), env=env, capture_output=True,
                       text=True, timeout=280)
    if _tree(target) != before or not is_run(target):
        return "silent wrong", "the restart took the existing run over"
    n = p.stderr.count("already exists; pass --force to overwrite it")
    if p.returncode != 0 and n >= 2:
        return "clean error", f"attempt 0 and the restart both refuse (RunExists, {n} lines); the run is untouched"
    return "unclear error", f"exit {p.returncode}: {p.stderr[-300:]}"


# ---------------------------------------------------------------------- values
@case("bad input", "a crafted SparseDDP checkpoint loaded as the README teaches (`weights_only=True`)")
def _readme_load():
    import pickle

    path, marker = Path(_TMP) / "ckpt.pt", Path(_TMP) / "pwned-readme"
    torch.save({"model": {"_extra_state": _Evil(str(marker))}}, path)
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"unsupported GLOBAL \S+", str(e))
        if marker.exists():
            return "silent wrong", "the payload ran"
        if found:
            return "clean error", f"UnpicklingError: ... Trying to load {found.group(0)} ... (payload not run)"
        return "unclear error", str(e)[:200]
    return "silent wrong", "loaded"


@case("bad input", "a finite gradient (3e38 on rank 1) that overflows the residual, every reducer with one")
def _residual_overflow():
    from sparsync.reducers.registry import load_all, make_reducer

    from sparsync import native

    bad = []
    for name, off in [(n, off) for n in sorted(load_all()) for off in (False, True)]:
        if name in ("dense", "s2"):  # dense keeps no residual; s2: the next row
            continue

        def w(comm, name=name):
            r = make_reducer(name, comm, 0.05)
            for step in range(6):
                g = torch.randn(4096, generator=torch.Generator().manual_seed(10 * step + comm.rank))
                out = r.reduce(3e38 * torch.sign(g) if comm.rank == 1 else g)
                if not torch.isfinite(out).all() or (r.residual is not None and not torch.isfinite(r.residual).all()):
                    return "non-finite, no error"
            return "ok"

        try:
            with native.switched_off() if off else contextlib.nullcontext():
                res = _thread(w)
            if not (name == "hard_threshold" and res[1] == "ok"):  # it sends every large entry: nothing overflows
                bad.append(f"{name}: {res[1]}")
        except FloatingPointError as e:
            if "residual overflowed" not in str(e):
                bad.append(f"{name}: {str(e)[:80]}")
    if bad:
        return "silent wrong", "; ".join(bad)
    return "clean error", ("FloatingPointError 'rank 1: <reducer>.reduce: the error-feedback residual overflowed at "
                           "step 1: gradient + residual is Inf/NaN in ~1970 of 4096 entries although the gradient "
                           "is finite ...' (C and torch kernels; hard_threshold sends every such entry)")


@case("bad input", "a finite gradient of 3e38 on rank 1 under s2 (its count sketch sums entries per cell)")
def _s2_sketch():
    from sparsync.reducers.registry import make_reducer

    def w(comm):
        r = make_reducer("s2", comm, 0.05)
        g = torch.randn(4096, generator=torch.Generator().manual_seed(comm.rank))
        out = r.reduce(3e38 * torch.sign(g) if comm.rank == 1 else g)
        return bool(torch.isfinite(out).all())

    try:
        finite = _thread(w)
    except FloatingPointError as e:
        if "sketch overflowed" in str(e):
            return "clean error", f"FloatingPointError: {str(e)[:200]}"
        return "unclear error", f"FloatingPointError: {str(e)[:200]}"
    return ("recovers", "output finite") if all(finite) else ("silent wrong", "the sketch table overflows: Inf out")


_TL = ["train-linear", "--backend", "thread", "--workers", "2", "--epochs", "1", "--samples", "400", "--features",
       "1000", "--nnz", "5"]

for _argv, _pattern in ((["--lr", "nan"], r"--lr must be a finite number"),
                        (["--lr", "-1"], r"--lr must be a finite number in \(0, inf\]"),
                        (["--l2", "nan"], r"--l2 must be a finite number"),
                        (["--global-batch", "0"], r"--global-batch: expected a positive integer")):
    case("bad input", f"`sparsync train-linear {' '.join(_argv)}`")(
        lambda a=_argv, p=_pattern: _main_case([*_TL, *a], 2, p))


def _svm_case(text, pattern):
    f = Path(_TMP) / "data.svm"
    f.write_text(text)
    return _main_case(["train-linear", "--backend", "thread", "--workers", "2", "--epochs", "1", "--test-fraction",
                       "0", "--data", str(f)], 2, pattern)


for _what, _text, _pattern in (
        ("a feature value 1e39 (beyond float32)", "1 1:0.5 2:1e39\n-1 3:1\n", r"beyond float32's range"),
        ("a feature index of 10^12", "1 1:0.5\n-1 1000000000000:1\n", r"not even one rank fits here"),
        ("a malformed line", "1 1:0.5\n-1 x:1\n", r"data.svm:2: feature 'x:1' is not of the form")):
    case("bad input", f"`sparsync train-linear --data FILE` with {_what}")(
        lambda t=_text, p=_pattern: _svm_case(t, p))

_LOOP = ["train", "--workload", "digits-mlp", "--workers", "2", "--reducer", "micro", "--steps", "2", "--no-progress"]
for _argv, _pattern in ((["--bandwidth", "1e30gbit"], r"bandwidth must be at most 1000gbit"),
                        (["--bandwidth", "1bit"], r"bandwidth must be at least 8kbit"),
                        (["--seed", str(2**70)], r"--seed must be an integer in \[0, 2147483647\]"),
                        (["--workload-option", "width=-5"], r"width must be at least 1"),
                        (["--workload-option", "width=0"], r"width must be at least 1"),
                        (["--workload-option", "width=abc"], r"width='abc': expected an integer"),
                        (["--workload-option", "width=1e9"], r"not even one rank fits here, by the available memory"),
                        (["--ddp-option", "nonfinite=bogus"], r"--ddp-option: nonfinite must be"),
                        (["--batch-size", "1e9"], r"by the available memory .*lower --batch-size"),
                        (["--checkpoint-every", "-1"], r"--checkpoint-every must be an integer >= 0"),
                        (["--bandwidth", "1gbit", "--rate-schedule", "2:1e30gbit"],
                         r"--rate-schedule '2:1e30gbit': bandwidth must be at most 1000gbit"),
                        (["--reducer", "hier", "--option", 'sites="0;1,2"'],
                         r"--option sites='0;1,2': sites 0;1,2 must hold every rank 0\.\.1 exactly once"),
                        (["--reducer", "nosuch", "--sync-every", "4"], r"unknown reducer 'nosuch'; valid: ")):
    case("bad input", f"`sparsync train {' '.join(_argv)}`")(
        lambda a=_argv, p=_pattern: _main_case(
            [*_LOOP, *a, "--runs-dir", str(Path(_TMP) / "values")], 2, p,
            lambda: "a run directory was created" if (Path(_TMP) / "values").exists() else None))



@case("bad input", "`SPARSYNC_SITES='0,1;2' sparsync train --reducer hier --workers 4`")
def _sites_env():
    old = os.environ.get("SPARSYNC_SITES")
    os.environ["SPARSYNC_SITES"] = "0,1;2"
    try:
        return _main_case([*_LOOP, "--reducer", "hier", "--workers", "4", "--runs-dir", str(Path(_TMP) / "sites")], 2,
                          r"SPARSYNC_SITES='0,1;2': sites 0,1;2 must hold every rank 0\.\.3 exactly once",
                          lambda: "a run directory was created" if (Path(_TMP) / "sites").exists() else None)
    finally:
        if old is None:
            os.environ.pop("SPARSYNC_SITES", None)
        else:
            os.environ["SPARSYNC_SITES"] = old


def _with_sites(spec, fn):
    old = os.environ.get("SPARSYNC_SITES")
    os.environ["SPARSYNC_SITES"] = spec
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("SPARSYNC_SITES", None)
        else:
            os.environ["SPARSYNC_SITES"] = old


_BENCH = ["bench", "reducers", "--numel", "1e3", "--steps", "1", "--warmup", "0"]
for _argv, _pattern in (([*_BENCH, "--workers", "4", "--bandwidth", "loopback,2000gbit"],
                         r"argument --bandwidth: bandwidth must be at most 1000gbit"),
                        (["plan", "--workers", "4", "--measure", "1e30gbit"],
                         r"argument --measure: bandwidth must be at most 1000gbit")):
    case("bad input", f"`sparsync {' '.join(_argv)}` (refused before the first network runs)")(
        lambda a=_argv, p=_pattern: _main_case(a, 2, p))


@case("bad input", "`SPARSYNC_SITES='0,1;2' sparsync bench reducers --reducers hier --workers 4` (before any row runs)")
def _sites_env_bench():
    return _with_sites("0,1;2", lambda: _main_case(
        [*_BENCH, "--reducers", "hier", "--workers", "4"], 2,
        r"SPARSYNC_SITES='0,1;2': sites 0,1;2 must hold every rank 0\.\.3 exactly once \(world size 4\)"))


# ---------------------------------------------------------------------- security
_PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
"""

_LOAD_AS_CHECKOUT = """
import sys
from pathlib import Path
from sparsync.native import loader
loader.PACKAGE_DIR = Path(sys.argv[1])  # no packaged library: the cache is where the kernels would come from
from sparsync import native
print(native.info())
"""


# ---------------------------------------------------------------------- states
#: options under which a reducer's conservation identity is exact on dyadic values (no decay, fp32)
_EXACT = {"sparseloco": {"value_bits": 32, "ef_decay": 1.0, "chunk": 100}}


def _saved_states(name, P, steps=70, **opts):
    from sparsync.reducers.registry import make_reducer

    def w(comm):
        r = make_reducer(name, comm, 0.05, **opts)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            r.reduce(torch.randint(-64, 65, (1200,), generator=g).float() / 64)
        return r.state_dict()

    return _thread(w, P=P)


@case("state", "every reducer's state saved at 4 ranks, resumed at 2 and at 8 (Ok-Topk's partition included)")
def _other_world_size():
    import warnings

    from sparsync.reducers.registry import load_all, make_reducer

    bad, names = [], sorted(n for n in load_all() if load_all().lookup(n).has_memory and n != "hier")
    for name in names:
        states = _saved_states(name, 4, **_EXACT.get(name, {}))
        for P in (2, 8):
            def w(comm, states=states, name=name):
                r = make_reducer(name, comm, 0.05, **_EXACT.get(name, {}))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if comm.rank < len(states):
                        r.load_state_dict(states[comm.rank])
                before = torch.zeros(1200) if r.residual is None else r.residual.clone()
                g = torch.randint(-64, 65, (1200,), generator=torch.Generator().manual_seed(9 + comm.rank)) / 64
                out = r.reduce(g.float())
                after = torch.zeros(1200) if r.residual is None else r.residual.clone()
                return g.float() + before, out, after, r.conserving

            res = _thread(w, P=P)
            fed, kept = sum(x[0] for x in res), sum(x[2] for x in res)
            if not all(torch.equal(x[1], res[0][1]) for x in res):
                bad.append(f"{name}@{P}: ranks differ")
            elif res[0][3] and not torch.equal(fed, res[0][1] + kept):
                bad.append(f"{name}@{P}: {float((fed - res[0][1] - kept).abs().max()):.3g} lost")
    if bad:
        return "silent wrong", "; ".join(bad)
    return "recovers", (f"all {len(names)} reducers with memory at 4 -> 2 and 4 -> 8 ranks: the loaded residuals "
                        "kept, the rest of the method (partitions, thresholds, step) started fresh with a warning; "
                        "the next step conserving and bitwise equal on every rank")


def _auto_with_carry(comm):
    """``auto`` after 3 calls on its first candidate, switched to the second: the first's residual carried."""
    from sparsync.reducers.registry import make_reducer

    r = make_reducer("auto", comm, 0.05, candidates=["topka:0.05", "micro:0.05"])
    for i in range(3):
        r.reduce(torch.randn(600, generator=torch.Generator().manual_seed(i)))
    r._switch(1)
    return r


@case("state", "crafted `auto` states: active -1 / 99 / 'x', a carried residual of shape (1,) or the wrong length")
def _crafted_auto():
    import copy as _copy


    def w(comm):
        r = _auto_with_carry(comm)
        good, out = r.state_dict(), []
        for key, value in (("active", -1), ("active", 99), ("active", "x"), ("carry", torch.full((1,), 1e3)),
                           ("carry", torch.zeros(599))):
            bad = _copy.deepcopy(good)
            bad["extra"][key] = value
            try:
                r.load_state_dict(bad)
                out.append(f"{key}={value!r}: accepted")
            except ValueError as e:
                out.append(str(e))
            if not torch.equal(r.state_dict()["extra"]["carry"], good["extra"]["carry"]):
                out.append("changed")
        return out

    got = _thread(w, P=2)[0]
    if any("accepted" in m or m == "changed" for m in got) or any("\n" in m for m in got):
        return "silent wrong", "; ".join(got)
    return "clean error", f"5 of 5 refused in one line, state unchanged: e.g. ValueError: {got[0]}; {got[3]}"


@case("state", "`auto` with a carried residual on the edge of fp32: the next call overflows")
def _auto_carry_overflow():

    def w(comm):
        r = _auto_with_carry(comm)
        r.residual = torch.full((600,), 3e38)
        before = r.residual.clone()
        try:
            r.reduce(torch.full((600,), 3e38))
        except FloatingPointError as e:
            return str(e).splitlines()[0], torch.equal(before, r.residual)
        return "no error", False

    msg, kept = _thread(w, P=1)[0]
    if msg == "no error" or not kept:
        return "silent wrong", f"{msg}; carry kept: {kept}"
    return "clean error", f"FloatingPointError: {msg} (the carried residual kept)"


@case("security", "an HF Trainer checkpoint whose sparsync_hook.pt runs os.system on load")
def _crafted_hf_hook():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "not tried", "transformers is not installed (make test-integrations installs it)"
    from sparsync.integrations import load_state_file

    path, marker = Path(_TMP) / "sparsync_hook.pt", Path(_TMP) / "pwned-hf"
    torch.save({"sparsync_gathered": 1, "world_size": 1, "states": [_Evil(str(marker))]}, path)
    try:
        load_state_file(path)
    except ValueError as e:
        if marker.exists():
            return "silent wrong", "the payload ran"
        return "clean error", f"ValueError: {str(e)[:180]} (payload not run)"
    return "silent wrong", "loaded"


@case("security", "a .so planted in the fallback cache by another user is not loaded")
def _planted_kernels():
    from sparsync.native import build

    if os.geteuid() != 0:
        return "not tried", "needs root to chown the planted library to another user"
    d = Path(_TMP) / "planted"
    d.mkdir()
    marker, src = d / "RAN", d / "planted.c"
    src.write_text(build.SOURCE.read_text() + _PLANTED)  # a real build of the kernels, plus a constructor
    lib = d / "planted.so"
    defines = [f'-DMARKER="{marker}"', f'-DSPARSYNC_SOURCE_SHA="{build.source_sha()}"']
    subprocess.run(build.compiler() + ["-O0", "-fPIC", "-shared", *defines, "-o", str(lib), str(src), "-lm"],
                   check=True, capture_output=True, timeout=120)
    cache, tmpdir, empty = d / "cache", d / "tmp", d / "no-package"
    for where in (cache / "native", tmpdir / f"sparsync-native-{os.getuid()}", empty):
        where.mkdir(parents=True)
    planted = cache / "native" / build.cache_name()
    for dest in (planted, tmpdir / f"sparsync-native-{os.getuid()}" / build.cache_name()):
        dest.write_bytes(lib.read_bytes())
        os.chown(dest, 12345, 12345)
    results = []
    for env in ({"SPARSYNC_CACHE": str(cache)}, {"SPARSYNC_CACHE": "/proc/x", "TMPDIR": str(tmpdir)}):
        out = subprocess.run([sys.executable, "-c", _LOAD_AS_CHECKOUT, str(empty)], capture_output=True, text=True,
                             env=dict(os.environ, SPARSYNC_NATIVE="1", **env), timeout=120)
        results.append((out.returncode, out.stdout + out.stderr))
    if marker.exists():
        return "silent wrong", "the planted library ran"
    (rc1, text1), (rc2, text2) = results
    if (rc1 == 0 and "could have been written by another user (owner uid 12345" in text1
            and rc2 == 0 and "'enabled': True" in text2 and "private temporary build" in text2):
        return "clean error", ("in the cache: refused, one warning 'could have been written by another user (owner "
                               "uid 12345 ...)', torch kernels; SPARSYNC_CACHE=/proc/x, one at the old $TMPDIR "
                               "fallback: built privately; the planted code never ran")
    return "unclear error", f"rc {rc1}: {text1[-150:]} / rc {rc2}: {text2[-150:]}"


# ---------------------------------------------------------------------- driver
_TMP = ""


def run_cases(only: str | None = None) -> list[tuple[str, str, str, str]]:
    global _TMP
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparsync-reliability-") as tmp:
        _TMP = tmp
        for kind, what, limit, fn in CASES:
            if only and only not in what:
                continue
            box: dict = {}

            def target(fn=fn, box=box):
                try:
                    box["out"] = fn()
                except BaseException as e:  # noqa: BLE001 - an unexpected error is an outcome too
                    box["out"] = ("unclear error", f"{type(e).__name__}: {str(e).strip()[:200]}")

            t = threading.Thread(target=target, daemon=True)
            t0 = time.monotonic()
            t.start()
            t.join(limit)
            outcome, detail = box.get("out", ("hang", f"no answer within {limit:.0f} s"))
            detail = detail.replace(tmp, "<tmp>").replace("|", "\\|").replace("\n", " ")
            rows.append((kind, what, outcome, detail if len(detail) <= 240 else detail[:237] + "..."))
            print(f"[{time.monotonic() - t0:5.1f}s] {outcome:13s} {what}", file=sys.stderr)
    return rows


def nonfinite_cost(n: int = 10_000_000, reps: int = 20) -> str:
    """Markdown table: the non-finite check of ``Reducer.reduce`` vs the passes around it, at ``n``."""
    x, r = torch.randn(n), torch.randn(n)

    def med(fn):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[reps // 2] * 1e3

    acc = med(lambda: x + r)
    rows = [("`grad + residual` (every error-feedback reducer makes it anyway)", acc),
            ("`torch.isfinite(grad).all()` (allocates an n-byte mask)", med(lambda: bool(torch.isfinite(x).all()))),
            ("**`torch.isfinite(grad.sum())` (what `reduce` does)**", med(lambda: bool(torch.isfinite(x.sum()))))]
    out = [f"| pass over n = {n:.0e} float32 | ms | vs `grad + residual` |", "|---|---|---|"]
    out += [f"| {w} | {t:.2f} | {t / acc:.2f}x |" for w, t in rows]
    return "\n".join(out)


def _replace(path: Path, marker: str, text: str) -> None:
    old = path.read_text() if path.exists() else f"<!-- {marker} -->\n<!-- /{marker} -->\n"
    path.write_text(re.sub(rf"<!-- {marker} -->.*?<!-- /{marker} -->",
                           lambda _: f"<!-- {marker} -->\n{text}\n<!-- /{marker} -->", old, flags=re.S))


def _merged(path: Path, rows) -> list[tuple[str, str, str, str]]:
    """The table of ``path`` with ``rows`` (an ``--only`` run) in place of the rows of the same cases,
    in the order of :data:`CASES`; a case neither run now nor in the file is left out."""
    old = {}
    m = re.search(r"<!-- table -->(.*?)<!-- /table -->", path.read_text() if path.exists() else "", flags=re.S)
    for line in (m.group(1) if m else "").splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0] not in ("kind", "---"):
            old[cells[1]] = (cells[0], cells[1], cells[2].strip("*"), cells[3])
    new = {r[1]: r for r in rows}
    return [new.get(what) or old[what] for _, what, _, _ in CASES if what in new or what in old]


def table(rows) -> str:
    return format_table([{"kind": k, "case": w, "outcome": f"**{o}**", "what": d} for k, w, o, d in rows],
                        [("kind", "kind"), ("case", "case"), ("outcome", "outcome"), ("what", "what happened")],
                        markdown=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/reliability.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="markdown file whose <!-- table --> section is replaced")
    ap.add_argument("--only", default=None, help="run the cases whose description contains this text (with --out: "
                    "their rows are replaced, the others kept)")
    ap.add_argument("--cost", action="store_true", help="measure the non-finite check instead (<!-- cost -->)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.cost:
        text = nonfinite_cost()
        if args.out:
            _replace(Path(args.out), "cost", text)
        print(text)
        return 0
    rows = run_cases(args.only)
    text = table(rows)
    if args.out:
        _replace(Path(args.out), "table", table(_merged(Path(args.out), rows)) if args.only else text)
    print(text)
    bad = [r for r in rows if r[2] in ("silent wrong", "hang", "unclear error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
