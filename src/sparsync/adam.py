"""AdamW whose second moment is frozen after a warm-up, as 1-bit Adam does (Tang et al. 2021).

Why: Adam's update ``m / (sqrt(v) + eps)`` is not linear in the gradient, because ``v`` is built
from the squares of the (averaged) gradients. Error-feedback compression relies on linearity - what
a rank holds back now is added back later and the sum of the updates is what dense training would
have done - so under a moving ``v`` the sparse, delayed gradients also change the preconditioner
(a coordinate sent once every k steps shows ``v`` a spike of ``(k g)^2`` instead of k values ``g^2``).
1-bit Adam observed that ``v`` stabilises early in training, runs plain Adam for a warm-up, then
keeps ``v`` fixed: the update becomes momentum SGD with a fixed per-coordinate preconditioner,
linear in the gradient, where error feedback is sound again.

:class:`FrozenVarianceAdamW` is :class:`torch.optim.AdamW` for the first ``freeze_after`` steps
(it calls torch's own step, so with ``freeze_after`` beyond the run it is AdamW bitwise); from then
on each parameter's ``exp_avg_sq`` is never written again and the bias correction of ``v`` stays at
its value of step ``freeze_after``, while the first moment, weight decay and learning rate go on
as in AdamW (torch's single-tensor arithmetic: ``p *= 1 - lr wd``, ``m = lerp(m, g, 1 - b1)``,
``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^T) + eps)``). Its state dict is AdamW's.

:class:`VelocityAdamW` is the same optimizer fed the *momentum* instead of the gradient, for error
feedback on the momentum (:mod:`sparsync.velocity_adam`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["FrozenVarianceAdamW"]


class FrozenVarianceAdamW(torch.optim.AdamW):
    """AdamW with ``exp_avg_sq`` frozen after ``freeze_after`` steps (module docstring).

    Args:
        params, lr, betas, eps, weight_decay: as :class:`torch.optim.AdamW`.
        freeze_after: number of plain AdamW steps before the second moment is frozen (>= 1).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 freeze_after: int = 1):
        if isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or freeze_after < 1:
            raise ValueError(f"FrozenVarianceAdamW: freeze_after must be an integer >= 1, got {freeze_after!r}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.freeze_after = freeze_after

    def _steps_done(self) -> int:
        return max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)

    @torch.no_grad()
    def step(self, closure=None):
        if self._steps_done() < self.freeze_after:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            b1, b2 = group["betas"]
            bc2_sqrt = math.sqrt(1 - b2 ** self.freeze_after)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                st = self.state[p]
                if "exp_avg_sq" not in st:
                    raise RuntimeError(f"{type(self).__name__}: a parameter received its first gradient after the "
                                       "second moment was frozen (it has no second moment to freeze)")
                st["step"] += 1
                t = int(st["step"])
                p.mul_(1 - lr * wd)
                self._first_moment(st, p.grad, b1)
                denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1 ** t))
        return loss

    def _first_moment(self, st: dict, grad: torch.Tensor, b1: float) -> None:
        """After the freeze: the new first moment from this step's input (AdamW's ``m = lerp(m, g, 1 - b1)``)."""
        st["exp_avg"].lerp_(grad, 1 - b1)
