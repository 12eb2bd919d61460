"""Chaos: runs of ``sparsync train`` in which a random rank or the launcher is
killed (SIGKILL) at a random moment - often during a checkpoint save, one every 2 steps. Each
time: every process and the store are gone within 5 s, a killed rank is named in a one-line error,
nothing but complete checkpoints stays on disk, and resuming gives the uninterrupted run's losses
bitwise. For micro, spardl and s2; seeded, so a failure reproduces."""

import json
import os
import random
import signal

import pytest
from faults_helpers import descendants, rank_pids, start_and_wait, train_cmd, wait_clean

from sparsync.train.loop import launch, validate
from sparsync.train.runs import RunDir, TrainConfig

STEPS, EVERY, P, RUNS = 14, 2, 2, 2


def _cfg(tmp_path, reducer, name):
    cfg = TrainConfig(workload="digits-mlp", workload_options={"width": 32}, reducer=reducer, density=0.05,
                      workers=P, steps=STEPS, eval_every=STEPS, checkpoint_every=EVERY, runs_dir=str(tmp_path),
                      name=name, network="loopback", progress=False, timeout=120)
    validate(cfg)
    return cfg


def _losses(path):
    return [json.loads(x)["loss"] for x in (path / "metrics.jsonl").read_text().splitlines()]


def _only_complete_checkpoints(path):
    rd = RunDir(path)
    stray = [str(f) for f in path.rglob("*") if ".tmp" in f.name]
    assert not stray, stray
    latest = rd.latest_step()
    for step in rd.checkpoint_steps():
        assert latest is not None and step <= latest, f"checkpoint {step} newer than latest {latest}"
        assert sorted(f.name for f in rd.ckpt_dir(step).iterdir()) == [f"rank{r}.pt" for r in range(P)]


@pytest.mark.gloo
@pytest.mark.parametrize("reducer", ["micro", "spardl", "s2"])
def test_chaos_kill_random_rank_or_launcher(tmp_path, reducer):
    rng = random.Random(f"chaos-{reducer}")
    launch(_cfg(tmp_path, reducer, "straight"))
    want = _losses(tmp_path / "straight")
    for i in range(RUNS):
        name = f"chaos{i}"
        victim = rng.choice(["launcher"] + list(range(P)))
        cmd = train_cmd(tmp_path, name, "--checkpoint-every", str(EVERY), reducer=reducer, workers=P,
                        steps=STEPS) + ["--eval-every", str(STEPS)]
        p = start_and_wait(cmd, tmp_path / name / "metrics.jsonl", lines=rng.randint(1, STEPS - 4))
        try:
            ranks = rank_pids(p.pid)
            below = descendants(p.pid)
            os.kill(p.pid if victim == "launcher" else ranks[victim], signal.SIGKILL)
            _, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
        assert wait_clean(p.pid, below, timeout=5.0) == {}, f"run {i}: leftovers after killing {victim}"
        if victim != "launcher" and p.returncode != 0:  # (a late kill may find the run finished)
            assert p.returncode == 1
            last = err.strip().splitlines()[-1]
            assert f"rank {victim} of {P} died without reporting (killed by SIGKILL)" in last, err[-2000:]
            assert "Traceback" not in err
            _only_complete_checkpoints(tmp_path / name)  # the launcher cleaned up after the failure
        rd = RunDir(tmp_path / name)
        launch(_cfg(tmp_path, reducer, name), resume=rd.latest_step() is not None,
               force=rd.latest_step() is None)
        assert _losses(tmp_path / name) == want, f"run {i} (killed {victim}) did not resume bitwise"
        _only_complete_checkpoints(tmp_path / name)
