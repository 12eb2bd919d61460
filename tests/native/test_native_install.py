"""The C kernels are compiled when the package is installed, and never after.

Real installs: ``pip install --no-build-isolation --no-deps --target DIR`` of a copy of this
checkout (setup.py's build hook), then a fresh interpreter imports the installed package with
``$CC`` set to a compiler that only leaves a marker file: the kernels load from the package and the
marker never appears. A build whose compiler fails still succeeds and leaves the reason in the
package (what the first use then warns with, once: ``test_native_loading.py``).
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparsync import native

REPO = Path(native.__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.skipif(not (REPO / "setup.py").exists(), reason="not a source checkout (no setup.py)"),
    pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="setuptools is not installed"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here"),
]

USE = """
import warnings, torch
from sparsync import native
from sparsync.select.threshold import threshold_indices
x = torch.randn(10000, generator=torch.Generator().manual_seed(0))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = threshold_indices(x, 2.0)
    threshold_indices(x, 2.0)
assert torch.equal(got, torch.nonzero(x.abs() >= 2.0).squeeze(1))
print(native.info())
print("warnings:", [str(w.message) for w in caught])
"""


def _install(tmp_path: Path, name: str, cc: str) -> Path:
    repo = tmp_path / f"{name}-repo"
    repo.mkdir()
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / f, repo / f)
    shutil.copytree(REPO / "src", repo / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "libsparsync_kernels.*"))
    site = tmp_path / f"{name}-site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                          "--no-index", "--target", str(site), str(repo)],
                         env=dict(os.environ, CC=cc), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return site


def _use(tmp_path: Path, site: Path) -> tuple[str, Path]:
    ran = tmp_path / "cc-ran"
    fake = tmp_path / "fake-cc"
    fake.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(site), CC=str(fake), SPARSYNC_CACHE=str(tmp_path / "cache"),
               SPARSYNC_NATIVE="1")
    out = subprocess.run([sys.executable, "-c", USE], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not ran.exists() and not (tmp_path / "cache").exists(), "a compiler ran after the install"
    return out.stdout, ran


def test_install_compiles_the_kernels_and_use_compiles_nothing(tmp_path):
    site = _install(tmp_path, "ok", "cc")
    assert (site / "sparsync" / "native" / "libsparsync_kernels.so").exists()
    stdout, _ = _use(tmp_path, site)
    assert "'enabled': True" in stdout and "'origin': 'installed with the package'" in stdout
    assert "warnings: []" in stdout


def test_a_build_without_a_compiler_succeeds_and_leaves_its_reason(tmp_path):
    """setup.py's hook when no compiler works: the build succeeds, says so, and puts the reason where
    the library would be (the installed package's first use warns with it: test_native_loading.py)."""
    lib = tmp_path / "lib"
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(lib),
                          "--build-temp", str(tmp_path / "tmp")],
                         cwd=REPO, env=dict(os.environ, CC="no-such-cc-sparsync"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("sparsync: C kernels not built (no C compiler ('no-such-cc-sparsync'") == 1
    native_dir = lib / "sparsync" / "native"
    assert not (native_dir / "libsparsync_kernels.so").exists()
    why = (native_dir / "libsparsync_kernels.unavailable").read_text()
    assert "no C compiler ('no-such-cc-sparsync' not found" in why
