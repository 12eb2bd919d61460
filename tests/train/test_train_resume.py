"""Run directories: resume gives the same metrics as an uninterrupted run; bad checkpoints and
existing directories are refused with clear messages."""

import json

import pytest
import torch

from sparsync.train.loop import launch, validate
from sparsync.train.runs import CheckpointError, RunExists, TrainConfig


def _cfg(tmp_path, name, steps, network="loopback", **kw):
    d = {"workload": "digits-mlp", "workload_options": {"width": 64}, "reducer": "topka", "density": 0.05,
         "workers": 4, "steps": steps, "eval_every": 3, "runs_dir": str(tmp_path), "name": name,
         "network": network, "progress": False, "timeout": 120}
    d.update(kw)
    cfg = TrainConfig(**d)
    validate(cfg)
    return cfg


def _losses(tmp_path, name):
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows], [r["loss"] for r in rows], {r["step"]: r["accuracy"] for r in rows
                                                                   if "accuracy" in r}


@pytest.mark.gloo
def test_resume_equals_uninterrupted_and_refusals(tmp_path):
    # uninterrupted 12 steps vs 6 steps + resume to 12 in fresh processes (error-feedback state included)
    launch(_cfg(tmp_path, "straight", 12))
    launch(_cfg(tmp_path, "split", 6))
    assert (tmp_path / "split" / "checkpoints" / "latest").read_text().strip() == "6"
    launch(_cfg(tmp_path, "split", 12), resume=True)
    s1, l1, a1 = _losses(tmp_path, "straight")
    s2, l2, a2 = _losses(tmp_path, "split")
    assert s1 == s2 == list(range(12))
    assert l1 == l2  # bitwise: same data order, same parameters, same residuals
    assert all(a1[k] == a2[k] for k in a1)
    summ = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summ["steps"] == 12 and summ["final_accuracy"] == a1[11]

    # existing run directory: refused without --force, replaced with it
    with pytest.raises(RunExists, match="--force"):
        launch(_cfg(tmp_path, "straight", 3))
    # mismatched configuration: refused, naming the difference
    with pytest.raises(CheckpointError, match="density"):
        launch(_cfg(tmp_path, "split", 14, density=0.1), resume=True)
    # corrupt checkpoint file: refused
    (tmp_path / "split" / "checkpoints" / "step_000012" / "rank2.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        launch(_cfg(tmp_path, "split", 14), resume=True)
    # a checkpoint of another run copied in: refused (fingerprint)
    other = _cfg(tmp_path, "other", 2, lr=0.5)
    launch(other)
    blob = torch.load(tmp_path / "other" / "checkpoints" / "step_000002" / "rank2.pt", weights_only=False)
    torch.save(blob, tmp_path / "split" / "checkpoints" / "step_000012" / "rank2.pt")
    with pytest.raises(CheckpointError, match="different configuration"):
        launch(_cfg(tmp_path, "split", 14), resume=True)
    # nothing to resume
    with pytest.raises(CheckpointError, match="does not exist"):
        launch(_cfg(tmp_path, "never-ran", 4), resume=True)


def test_resume_thread_backend_with_periodic_checkpoints(tmp_path):
    """Same property on the thread backend, resuming from a mid-run checkpoint (--checkpoint-every)."""
    launch(_cfg(tmp_path, "a", 8, network="thread", reducer="dense"))
    launch(_cfg(tmp_path, "b", 8, network="thread", reducer="dense", checkpoint_every=4))
    # pretend the run died after step 5: metrics past the checkpoint are dropped on resume
    (tmp_path / "b" / "checkpoints" / "latest").write_text("4\n")
    launch(_cfg(tmp_path, "b", 8, network="thread", reducer="dense", checkpoint_every=4), resume=True)
    assert _losses(tmp_path, "a")[:2] == _losses(tmp_path, "b")[:2]


def test_launch_builds_the_c_kernels_before_any_rank_starts(tmp_path, monkeypatch):
    """The first use compiles them (seconds with 4 ranks at once): that must not land in a timed step."""
    from sparsync import launch as launch_mod
    from sparsync import native

    order = []
    monkeypatch.setattr(native, "enabled", lambda: order.append("native") or True)
    real = launch_mod.run_local
    monkeypatch.setattr(launch_mod, "run_local", lambda *a, **k: order.append("ranks") or real(*a, **k))
    launch(_cfg(tmp_path, "built", 1, network="thread", workers=2))
    assert order[:2] == ["native", "ranks"]
