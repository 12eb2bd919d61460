"""Shared by the trainer scripts (run under torchrun by tests/hook/test_integrations.py)."""

import os
import sys

import torch
from torch import nn

REDUCER, DENSITY = "topka", 0.1


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))


def data(n=64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def out_dir():
    return sys.argv[1]


def rank():
    return int(os.environ["RANK"])


def save(result):
    torch.save(result, os.path.join(out_dir(), f"rank{rank()}.pt"))


def hook_used(hook):
    """The hook reduced sparsely: reducers exist and the last step's density is below 1."""
    return bool(hook is not None and hook.reducers and all(s["density"] < 0.5 for s in hook.last_stats.values()))
