"""Checkpoints on hostile disks: a crafted checkpoint cannot run code,
old checkpoints are pruned, temp files of killed saves and incomplete checkpoints are removed, and
a full disk during a save is a clear error that leaves the previous checkpoint in charge."""

import errno
import json
import os
import subprocess

import pytest
import torch
from faults_helpers import tmpfs

from sparsync.train import runs as runs_mod
from sparsync.train.loop import launch, validate
from sparsync.train.runs import CheckpointError, TrainConfig


def _cfg(tmp_path, name, steps, **kw):
    d = {"workload": "digits-mlp", "workload_options": {"width": 32}, "reducer": "micro", "density": 0.05,
         "workers": 2, "steps": steps, "eval_every": 2, "runs_dir": str(tmp_path), "name": name,
         "network": "thread", "progress": False, "timeout": 60}
    d.update(kw)
    cfg = TrainConfig(**d)
    validate(cfg)
    return cfg


def _losses(tmp_path, name):
    return [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_checkpoint_does_not_run_code(tmp_path):
    launch(_cfg(tmp_path, "run", 2))
    ck = tmp_path / "run" / "checkpoints" / "step_000002" / "rank0.pt"
    marker = tmp_path / "pwned"
    blob = torch.load(ck, weights_only=True)
    blob["loop"] = _Evil(marker)  # a real checkpoint with one poisoned entry
    torch.save(blob, ck)
    torch.load(ck, weights_only=False)  # the payload is live: unsafe loading runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match="could run code"):
        launch(_cfg(tmp_path, "run", 4), resume=True)
    assert not marker.exists()


def test_malformed_checkpoint_is_refused_before_use(tmp_path):
    launch(_cfg(tmp_path, "run", 2))
    ck = tmp_path / "run" / "checkpoints" / "step_000002" / "rank1.pt"
    blob = torch.load(ck, weights_only=True)
    blob["model"] = [1, 2, 3]
    torch.save(blob, ck)
    with pytest.raises(CheckpointError, match=r"malformed \(missing or wrong type: model\)"):
        launch(_cfg(tmp_path, "run", 4), resume=True)


def test_keep_checkpoints_prunes_old_ones(tmp_path):
    launch(_cfg(tmp_path, "keep2", 8, checkpoint_every=2))
    launch(_cfg(tmp_path, "keep0", 8, checkpoint_every=2, keep_checkpoints=0))
    launch(_cfg(tmp_path, "keep1", 8, checkpoint_every=2, keep_checkpoints=1))
    steps = {n: sorted(p.name for p in (tmp_path / n / "checkpoints").iterdir() if p.is_dir())
             for n in ("keep2", "keep0", "keep1")}
    assert steps["keep2"] == ["step_000006", "step_000008"]
    assert steps["keep0"] == [f"step_{s:06d}" for s in (2, 4, 6, 8)]
    assert steps["keep1"] == ["step_000008"]
    with pytest.raises(ValueError, match="keep-checkpoints must be >= 0"):
        _cfg(tmp_path, "bad", 2, keep_checkpoints=-1)


def test_resume_removes_temp_files_and_incomplete_checkpoints(tmp_path):
    launch(_cfg(tmp_path, "straight", 8))
    launch(_cfg(tmp_path, "split", 8, checkpoint_every=4))
    ck = tmp_path / "split" / "checkpoints"
    (ck / "latest").write_text("4\n")  # pretend it died during/after the step-8 save
    (ck / "step_000004" / "rank0.tmp4242").write_bytes(b"x" * 1000)  # a killed save's temp file
    (ck / "latest.tmp77").write_text("8")
    (tmp_path / "split" / "config.json.tmp5").write_text("{")
    launch(_cfg(tmp_path, "split", 8, checkpoint_every=4), resume=True)
    assert _losses(tmp_path, "straight") == _losses(tmp_path, "split")  # bitwise
    assert not [f for f in _files(tmp_path / "split") if ".tmp" in f]
    assert (ck / "latest").read_text().strip() == "8"


def test_full_disk_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    real_save = torch.save

    def save(obj, f, *a, **k):
        if "step_000004" in str(f) and "rank1" in str(f):
            with open(f, "wb") as fh:  # a partial write, then the disk is full
                fh.write(b"PK\x03\x04partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *a, **k)

    launch(_cfg(tmp_path, "straight", 6))
    monkeypatch.setattr(runs_mod.torch, "save", save)
    with pytest.raises(CheckpointError, match=r"rank 1: could not write checkpoint .*step_000004.*No space left "
                                              r"on device \(disk full\? \d+ bytes free there\); the previous"):
        launch(_cfg(tmp_path, "full", 6, checkpoint_every=2))
    ck = tmp_path / "full" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "2"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000002"]  # nothing partial left
    monkeypatch.setattr(runs_mod.torch, "save", real_save)
    launch(_cfg(tmp_path, "full", 6, checkpoint_every=2), resume=True)
    assert _losses(tmp_path, "straight") == _losses(tmp_path, "full")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_real_full_tmpfs_is_a_one_line_error_and_resume_works(tmp_path):
    import sys

    # one rank file of this model is ~60 kB: room for the first checkpoints, not for all of them
    with tmpfs(tmp_path / "small", "size=600k") as mnt:
        cmd = [sys.executable, "-m", "sparsync.cli", "train", "--thread", "--workload", "digits-mlp",
               "--workload-option", "width=32", "--reducer", "micro", "--density", "0.05", "--workers", "2",
               "--steps", "40", "--checkpoint-every", "2", "--keep-checkpoints", "0", "--runs-dir", str(mnt),
               "--name", "r", "--no-progress"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "rank " in lines[0], out.stderr
        assert "disk full?" in lines[0] or "No space left on device" in lines[0], out.stderr
        latest = int((mnt / "r" / "checkpoints" / "latest").read_text())
        dirs = sorted(p.name for p in (mnt / "r" / "checkpoints").iterdir() if p.is_dir())
        assert dirs[-1] == f"step_{latest:06d}" and not [f for f in _files(mnt / "r") if ".tmp" in f]
        # the checkpoint `latest` names is complete and loads
        for r in range(2):
            runs_mod.load_checkpoint(mnt / "r" / "checkpoints" / dirs[-1] / f"rank{r}.pt",
                                     TrainConfig.from_dict(json.loads((mnt / "r" / "config.json").read_text())), r)


# ---------------------------------------------------------------------- weights_only=True, as the README teaches
def _state_roundtrip(comm):
    """torch DDP + ``ss.ddp_hook`` and SparseDDP, each saved after 4 steps as plain state
    (``hook.state_dict()``, ``SparseDDP.state_dict()``), read back with ``torch.load(...,
    weights_only=True)`` into fresh objects, and stepped 4 more: bitwise the uninterrupted run."""
    import copy
    import io

    from torch import nn

    import sparsync as ss

    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 3))

    def steps(model, opt, lo, hi):
        for s in range(lo, hi):
            g = torch.Generator().manual_seed(100 * s + comm.rank)
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    def roundtrip(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)  # tensors and plain data only

    out = []
    for kind in ("hook", "sparseddp"):
        def build(kind=kind):
            if kind == "hook":
                m = nn.parallel.DistributedDataParallel(copy.deepcopy(net))
                h = ss.ddp_hook("topka", density=0.25, module=m, asynchronous=False)
                m.register_comm_hook(m, h)
                return m, h, torch.optim.SGD(m.parameters(), lr=0.1)
            m = ss.SparseDDP(copy.deepcopy(net), comm, reducer="micro", density=0.25)
            return m, m, torch.optim.SGD(m.parameters(), lr=0.1)

        straight, _, o1 = build()
        steps(straight, o1, 0, 8)
        first, state, o2 = build()
        steps(first, o2, 0, 4)
        blob = roundtrip({"state": state.state_dict(), "opt": o2.state_dict(),
                          "model": first.module.state_dict()})
        again, state2, o3 = build()
        again.module.load_state_dict(blob["model"])
        state2.load_state_dict(blob["state"])
        o3.load_state_dict(blob["opt"])
        steps(again, o3, 4, 8)
        out.append(all(torch.equal(a, b) for a, b in zip(straight.module.parameters(), again.module.parameters())))
        for m in (straight, first, again):
            if hasattr(m, "close"):
                m.close()
    return out


@pytest.mark.gloo
def test_hook_and_sparseddp_state_load_with_weights_only_true():
    import sparsync as ss

    assert ss.run_local(_state_roundtrip, 2, backend="gloo", timeout=120) == [[True, True], [True, True]]
