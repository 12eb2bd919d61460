"""The trainer integrations (sparsync.integrations) with the real clients: two gloo ranks under torchrun
train with the sparsync hook; parameters are bitwise equal across ranks; a checkpoint written by one rank
+ resume is bitwise equal to the uninterrupted run; and without the hook the result differs (the hook
really ran). Each test is skipped when its client is not installed, and fails instead under
``SPARSYNC_REQUIRE_INTEGRATIONS=1`` (``make test-integrations``, which CI runs after installing them).
The ranks run under a timeout: a regression fails, never hangs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gloo

SCRIPTS = Path(__file__).parent / "integration_scripts"
SRC = Path(__file__).resolve().parents[2] / "src"


def _client(name: str):
    """``pytest.importorskip(name)``, or an import that fails the test where the clients are required."""
    if os.environ.get("SPARSYNC_REQUIRE_INTEGRATIONS"):
        return __import__(name)
    return pytest.importorskip(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: str, tmp_path, timeout: float = 240) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONFAULTHANDLER": "1"}  # an abort at exit prints every thread's Python stack
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(SCRIPTS / script), str(tmp_path)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{script} did not finish in {timeout} s:\n{(e.stderr or '')[-3000:]}") from None
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-4000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _check(res):
    for r, out in enumerate(res):
        assert out["used"], f"rank {r}: the sparsync hook did not reduce"
        assert out["in_ckpt"], f"rank {r}: the checkpoint holds no sparsync state"
        assert torch.equal(out["straight"], out["resumed"]), f"rank {r}: resume is not bitwise the straight run"
        assert not torch.equal(out["straight"], out["dense"]), f"rank {r}: the hooked run equals the dense one"
    assert torch.equal(res[0]["straight"], res[1]["straight"]), "ranks diverged"
    assert torch.equal(res[0]["resumed"], res[1]["resumed"]), "ranks diverged after the resume"


def test_lightning_callback(tmp_path):
    _client("lightning")
    _check(_torchrun("lightning_train.py", tmp_path))


def test_accelerate_recipe(tmp_path):
    _client("accelerate")
    _check(_torchrun("accelerate_train.py", tmp_path))


def test_hf_trainer_callback(tmp_path):
    _client("transformers")
    res = _torchrun("hf_train.py", tmp_path)
    _check(res)
    assert res[0]["find_unused"] is True  # the Trainer's default: the hook's own group keeps it deadlock-free


@pytest.mark.parametrize("mod,client", [("lightning", "lightning"), ("accelerate", "accelerate"),
                                        ("hf", "transformers")])
def test_missing_client_is_one_line_and_package_imports_none(mod, client):
    code = ("import sys\n"
            "for m in ('lightning', 'lightning.pytorch', 'pytorch_lightning', 'accelerate', 'transformers'):\n"
            "    sys.modules[m] = None  # as if not installed\n"
            "import sparsync.integrations\n"
            "assert not any(k.split('.')[0] in ('lightning', 'accelerate', 'transformers') and sys.modules[k]\n"
            "               for k in list(sys.modules))\n"
            "try:\n"
            f"    import sparsync.integrations.{mod}\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    msg = out.stdout.strip()
    assert f"pip install {client}" in msg and "\n" not in msg, msg


_CRAFTED = r"""
import os, sys, types, pickle, tempfile, torch, torch.distributed as dist
out, marker = sys.argv[1], sys.argv[2]

class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
import sparsync.integrations.hf as hf
ckpt = os.path.join(out, "checkpoint-3")
os.makedirs(ckpt)
torch.save({"sparsync_gathered": 1, "world_size": 1, "states": [Payload()]}, os.path.join(ckpt, hf.FILE_NAME))
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
cb = hf.SparsyncTrainerCallback(types.SimpleNamespace(model_wrapped=model), "topka", density=0.5)
try:
    cb.on_train_begin(types.SimpleNamespace(world_size=1, output_dir=out), types.SimpleNamespace(global_step=3), None)
except ValueError as e:
    print("REFUSED", e)
dist.destroy_process_group()
"""


def test_crafted_hf_checkpoint_runs_no_code(tmp_path):
    """A ``sparsync_hook.pt`` whose pickle calls ``os.system`` on load: the callback refuses it in one
    line naming the file, and the payload never runs (its marker file is not created)."""
    _client("transformers")
    marker = tmp_path / "payload-ran"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _CRAFTED, str(tmp_path), str(marker)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not marker.exists(), "the crafted checkpoint ran its payload"
    line = [x for x in out.stdout.splitlines() if x.startswith("REFUSED")]
    assert line and "sparsync_hook.pt" in line[0], out.stdout
