"""What the engine does with non-finite and missing gradients (the step's policy, decided alike on every rank).

* Non-finite gradients (``nonfinite=``): a group whose local gradient holds a NaN/Inf is replaced
  by zeros *before* the reducer sees it, so residuals never absorb NaN. ``"error"`` (default)
  raises ``FloatingPointError`` on the rank that saw it after the step's communication (no extra
  collective; the launcher - ``run_local`` or torchrun - then stops every rank). ``"skip"``: one tiny
  flag all-gather per step tells every rank, and all drop the step (every ``.grad`` set to None, so
  ``optimizer.step()`` changes nothing). ``"ignore"``: no check.
* Unused parameters (``unused=``): ``"zero"`` (default) - a parameter without a gradient
  contributes zeros (torch DDP's ``find_unused_parameters=True``, no hang); ``"error"`` raises on
  every rank (the flags are exchanged so all ranks agree).

The local check costs one read pass and no allocation: ``sum(x)`` is non-finite whenever an entry
is (NaN and ±Inf propagate through a sum), and only then is the exact ``isfinite`` test run (a sum of
finite values can overflow, which the exact test tells apart).
"""

from __future__ import annotations

import math

import torch

__all__ = ["StepGuard", "all_finite"]


def all_finite(x: torch.Tensor) -> bool:
    """True when every entry of ``x`` is finite (one pass, no allocation in the common case)."""
    if x.numel() == 0:
        return True
    if math.isfinite(float(x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32))):
        return True
    return bool(torch.isfinite(x).all())


class StepGuard:
    def __init__(self, nonfinite: str = "error", unused: str = "zero"):
        if nonfinite not in ("error", "skip", "ignore"):
            raise ValueError(f"nonfinite must be 'error', 'skip' or 'ignore', got {nonfinite!r}")
        if unused not in ("zero", "error"):
            raise ValueError(f"unused must be 'zero' or 'error', got {unused!r}")
        self.nonfinite = nonfinite
        self.unused = unused

    @property
    def checks(self) -> bool:
        return self.nonfinite != "ignore"

    @property
    def needs_exchange(self) -> bool:
        """Every rank must take the same decision: only ``skip`` and ``unused="error"`` need flags."""
        return self.nonfinite == "skip" or self.unused == "error"

    def flags(self, comm, n_bad: int, n_unused: int) -> dict[int, list[int]]:
        """``{rank: [non-finite groups, unused parameters]}``: all ranks when exchanged, else this one."""
        if not self.needs_exchange:
            return {comm.rank: [n_bad, n_unused]}
        with comm.unrecorded():
            v = torch.tensor([n_bad, n_unused], dtype=torch.int64, device=comm.device)
            return {r: t.cpu().tolist() for r, t in enumerate(comm.allgather(v))}

    def decide(self, flags, *, rank, step, unused_names, bad_names) -> bool:
        """Raise as the policy says, or return True when the step must be skipped on every rank."""
        if self.unused == "error" and any(f[1] for f in flags.values()):
            raise RuntimeError(
                f"rank {rank}: parameters received no gradient this step on ranks "
                f"{[r for r, f in flags.items() if f[1]]} (here: {unused_names[:8]}); pass unused='zero' to "
                "let them contribute zeros (like DDP's find_unused_parameters)")
        bad_ranks = [r for r, f in flags.items() if f[0]]
        if not bad_ranks:
            return False
        if self.nonfinite == "error":
            raise FloatingPointError(
                f"rank {rank}: non-finite (NaN/Inf) gradients at step {step} on ranks {bad_ranks}"
                + (f" (here in {bad_names[:8]})" if bad_names else "") + "; pass nonfinite='skip' to drop such steps")
        return True
