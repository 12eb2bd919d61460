"""Shared test set-up: one torch thread per process (ranks share 2 cores), and skips that say why
(tests marked ``cuda`` are skipped at collection where torch sees no CUDA device)."""

import os
import shutil

import pytest
import torch

torch.set_num_threads(1)
# torch.cuda.is_available() below asks NVML, not the driver: a driver query here would leave every
# forked gloo rank of the tests unable to use CUDA (sparsync.launch._pick_start_method)
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def pytest_collection_modifyitems(config, items):
    """Skip the ``cuda`` tests where torch sees no GPU (CPU-only CI): one check, only if any is collected."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if marked and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in marked:
            item.add_marker(skip)


def _netns_reason():
    if os.geteuid() != 0:
        return "emulated network needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "emulated network needs iproute2 (ip, tc)"
    return None


@pytest.fixture
def needs_netns():
    reason = _netns_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(params=["default", "torch"])
def kernel(request):
    """Run a test twice: "default" with the C kernels of :mod:`sparsync.native` when they build here,
    "torch" with them switched off (the torch kernels they replace)."""
    from sparsync import native

    if request.param == "torch":
        with native.switched_off():
            yield request.param
    else:
        yield request.param
