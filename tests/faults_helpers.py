"""Process and disk inspection shared by the fault tests (no mocks: real processes, real files)."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path


def _load_harness():
    """The fault-injection harness ``tools/reliability.py`` (a tool, not part of the package)."""
    path = Path(__file__).resolve().parents[1] / "tools" / "reliability.py"
    spec = importlib.util.spec_from_file_location("sparsync_tools_reliability", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


harness = sys.modules.get("sparsync_tools_reliability") or _load_harness()
alive, descendants, leftovers = harness.alive, harness.descendants, harness.leftovers
rank_pids, wait_clean, tmpfs = harness.rank_pids, harness.wait_clean, harness.tmpfs

__all__ = ["harness", "alive", "descendants", "leftovers", "rank_pids", "wait_clean", "tmpfs", "train_cmd",
           "start_and_wait"]


def train_cmd(runs_dir, name, *extra, reducer="micro", workers=2, steps=100000, width=32) -> list[str]:
    return [sys.executable, "-m", "sparsync.cli", "train", "--workload", "digits-mlp", "--workload-option",
            f"width={width}", "--reducer", reducer, "--density", "0.05", "--workers", str(workers), "--steps",
            str(steps), "--eval-every", str(max(steps, 1)), "--runs-dir", str(runs_dir), "--name", name,
            "--no-progress", "--timeout", "120", *extra]


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_and_wait(cmd, metrics: Path, lines: int = 2, timeout: float = 240.0, env=None) -> subprocess.Popen:
    """Start ``cmd`` and wait until ``metrics`` has ``lines`` records (the ranks are training)."""
    # the launcher starts with SIGINT at its default, as a program started in a terminal does: a
    # test run started in the background by a non-interactive shell (``cmd &``) has SIGINT ignored,
    # which every child inherits - and a program that starts with SIGINT ignored rightly keeps it so
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=_sigint_default)
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
