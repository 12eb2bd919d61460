"""The few DiLoCo steps the reducer tests take on a tiny regression model (each rank its own data)."""

from __future__ import annotations

import torch


def run_steps(model, opt, dl, rank: int, steps: int = 4) -> torch.Tensor:
    """``steps`` calls of ``dl.step()`` on random regression batches seeded by ``rank``; the module's
    parameters afterwards, flattened."""
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        dl.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
