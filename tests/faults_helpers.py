"""Process and disk inspection shared by the fault tests (no mocks: real processes, real files)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sparsync.cluster import PREFIX, list_namespaces
from sparsync.launch import STORE_PREFIX


def proc_state(pid: int) -> str | None:
    """Kernel state letter of ``pid`` (R, S, T, Z, ...), None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Exists and is not a zombie (a reaped-late zombie runs nothing and holds nothing)."""
    return proc_state(pid) not in (None, "Z", "X")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...)."""
    kids: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the rank processes of a launcher (named ``ss<launcher pid>r<rank>``)."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{d}/comm").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(rf"ss{launcher_pid}r(\d+)", comm)
        if m and alive(int(d)):
            out[int(m.group(1))] = int(d)
    return out


def leftovers(launcher_pid: int, pids) -> dict:
    """What a launcher left: live processes among ``pids``, its stores, its namespaces."""
    return {"processes": [p for p in pids if alive(p)],
            "stores": glob.glob(os.path.join(tempfile.gettempdir(), f"{STORE_PREFIX}{launcher_pid}-*")),
            "namespaces": [n for n in list_namespaces() if n.startswith(f"{PREFIX}{launcher_pid}s")]}


def wait_clean(launcher_pid: int, pids, timeout: float = 5.0) -> dict:
    """Poll until nothing is left (returns {} then) or ``timeout`` passes (returns what is left)."""
    end = time.monotonic() + timeout
    while True:
        left = {k: v for k, v in leftovers(launcher_pid, pids).items() if v}
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def train_cmd(runs_dir, name, *extra, reducer="micro", workers=2, steps=100000, width=32) -> list[str]:
    return [sys.executable, "-m", "sparsync.cli", "train", "--workload", "digits-mlp", "--workload-option",
            f"width={width}", "--reducer", reducer, "--density", "0.05", "--workers", str(workers), "--steps",
            str(steps), "--eval-every", str(max(steps, 1)), "--runs-dir", str(runs_dir), "--name", name,
            "--no-progress", "--timeout", "120", *extra]


def start_and_wait(cmd, metrics: Path, lines: int = 2, timeout: float = 240.0, env=None) -> subprocess.Popen:
    """Start ``cmd`` and wait until ``metrics`` has ``lines`` records (the ranks are training)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if p.poll() is not None:
            raise AssertionError(f"launcher ended early ({p.returncode}): {p.stderr.read()[-2000:]}")
        try:
            if len(metrics.read_text().splitlines()) >= lines:
                return p
        except OSError:
            pass
        time.sleep(0.02)
    p.kill()
    raise AssertionError(f"no training progress within {timeout}s")
