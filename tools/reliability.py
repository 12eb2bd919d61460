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


@case("bad input", "`--runs-dir` on a read-only filesystem")
def _runs_dir_ro():
    if os.geteuid() != 0:
        return "not tried", "needs root to mount a read-only tmpfs"
    d = Path(_TMP) / "ro"
    d.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], check=True)
    try:
        return _cli_case(["train", *_SMALL, "--steps", "2", "--runs-dir", str(d), "--name", "x"], 2,
                         "Read-only file system")
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


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
def _launch_and_kill(name, victim, sig=signal.SIGKILL, extra=()):
    metrics = Path(_TMP) / name / "metrics.jsonl"
    cmd = [sys.executable, "-m", "sparsync.cli", "train", "--workload", "digits-mlp", "--workload-option",
           "width=16", "--reducer", "micro", "--workers", "2", "--steps", "100000", "--eval-every", "100000",
           "--runs-dir", _TMP, "--name", name, "--no-progress", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 240
    while time.monotonic() < end and p.poll() is None:
        with contextlib.suppress(OSError):
            if len(metrics.read_text().splitlines()) >= 2:
                break
        time.sleep(0.02)
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


def table(rows) -> str:
    return format_table([{"kind": k, "case": w, "outcome": f"**{o}**", "what": d} for k, w, o, d in rows],
                        [("kind", "kind"), ("case", "case"), ("outcome", "outcome"), ("what", "what happened")],
                        markdown=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/reliability.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="markdown file whose <!-- table --> section is replaced")
    ap.add_argument("--only", default=None, help="run the cases whose description contains this text")
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
        _replace(Path(args.out), "table", text)
    print(text)
    bad = [r for r in rows if r[2] in ("silent wrong", "hang", "unclear error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
