"""Every ```python block of README.md (and of docs/architecture.md) runs as printed: each in its own
Python process (the package from this tree on the path), under a timeout, and must exit 0 and print
something."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = [b for doc in ("README.md", "docs/architecture.md")
          for b in re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(), flags=re.S | re.M)]


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4  # the quick start, the comm hook, DiLoCo and architecture.md's


@pytest.mark.gloo
@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(i, tmp_path):
    script = tmp_path / f"readme_block{i}.py"
    script.write_text(BLOCKS[i])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=180, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"README block {i} did not finish in 180 s:\n{BLOCKS[i]}\n{(e.stderr or '')[-2000:]}") \
            from None
    assert proc.returncode == 0, f"README block {i} failed:\n{BLOCKS[i]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"README block {i} printed nothing"
