"""Shared test set-up: one torch thread per process (ranks share 2 cores), and skips that say why."""

import os
import shutil

import pytest
import torch

torch.set_num_threads(1)


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
