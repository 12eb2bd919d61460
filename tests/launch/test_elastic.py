"""Elastic restart: under ``torchrun --max-restarts 1`` a rank killed with SIGKILL
makes the group restart, and ``sparsync train`` resumes by itself from the latest complete
checkpoint - bitwise the run an uninterrupted job makes (residuals, thresholds, optimizer, data)."""

import json
import os
import signal
import sys

import pytest
from faults_helpers import descendants, start_and_wait

from sparsync.train.loop import launch, validate
from sparsync.train.runs import TrainConfig

STEPS, EVERY, P = 40, 4, 4
ARGS = ["--workload", "digits-mlp", "--workload-option", "width=32", "--reducer", "micro", "--density", "0.05",
        "--steps", str(STEPS), "--eval-every", "8", "--checkpoint-every", str(EVERY), "--no-progress"]


def _rank_of(pid):
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.gloo
def test_kill9_one_rank_of_four_under_torchrun_restarts_and_resumes_bitwise(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [torchrun, "--nproc-per-node", str(P), "--max-restarts", "1", "--monitor-interval", "0.2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "sparsync.cli", "train", *ARGS,
           "--runs-dir", str(tmp_path), "--name", "elastic"]
    metrics = tmp_path / "elastic" / "metrics.jsonl"
    p = start_and_wait(cmd, metrics, lines=EVERY + 3, env=env)
    try:
        workers = {_rank_of(pid): pid for pid in descendants(p.pid)}
        os.kill(workers[2], signal.SIGKILL)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    assert "local_rank: 2" in err  # torchrun saw the failure and restarted the group
    assert "final accuracy" in out

    ref = TrainConfig(workload="digits-mlp", workload_options={"width": 32}, reducer="micro", density=0.05,
                      workers=P, steps=STEPS, eval_every=8, checkpoint_every=EVERY, runs_dir=str(tmp_path),
                      name="straight", network="loopback", progress=False, timeout=120)
    validate(ref)
    launch(ref)
    got, want = _rows(metrics), _rows(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(STEPS))  # the restart's metrics replace the lost ones
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bitwise
    assert [r.get("accuracy") for r in got] == [r.get("accuracy") for r in want]
    ck = tmp_path / "elastic" / "checkpoints"
    assert sorted(x.name for x in ck.iterdir()) == ["latest", f"step_{STEPS - EVERY:06d}", f"step_{STEPS:06d}"]


@pytest.mark.gloo
def test_a_restart_does_not_get_past_the_already_exists_refusal(tmp_path):
    """Attempt 0 refuses an existing run directory (no --force); the restart must refuse it too, not
    take it over: only a run this torchrun job created itself is resumed or started over. (A
    directory that is no sparsync run is never deleted at all: tests/train/test_run_dirs.py.)"""
    import subprocess

    from sparsync.train.runs import is_run

    target = tmp_path / "taken"
    ref = TrainConfig(workload="digits-mlp", workload_options={"width": 16}, reducer="micro", workers=1, steps=2,
                      runs_dir=str(tmp_path), name="taken", network="thread", progress=False)
    validate(ref)
    launch(ref)
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [torchrun, "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "sparsync.cli", "train", *ARGS,
           "--workload-option", "width=16", "--runs-dir", str(tmp_path), "--name", "taken"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0
    assert p.stderr.count("already exists; pass --force to overwrite it") >= 2, p.stderr[-3000:]  # both attempts
    assert sorted(str(q.relative_to(target)) for q in target.rglob("*")) == before  # untouched
    assert is_run(target) and (target / "summary.json").exists()
