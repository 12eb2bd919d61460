"""The few DiLoCo steps the tests take on tiny models (each rank its own data)."""

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


def classify_step(model, dl, step: int, rank: int, inputs: int = 8, classes: int = 4, batch: int = 16,
                  seed_base: int = 1000) -> None:
    """One ``dl.step()`` on a random classification batch seeded by ``seed_base * step + rank``."""
    g = torch.Generator().manual_seed(seed_base * step + rank)
    x, y = torch.randn(batch, inputs, generator=g), torch.randint(0, classes, (batch,), generator=g)
    dl.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    dl.step()
