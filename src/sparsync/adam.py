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

``precondition=True`` moves the division by the frozen ``d = sqrt(v) / sqrt(1 - b2^T) + eps`` in
front of the gradient exchange: from the freeze on, a hook on every parameter divides each rank's
gradient by ``d`` as autograd produces it (before a data-parallel engine such as SparseDDP sees it),
the first moment is kept in the same scaled units (divided by ``d`` once, at the freeze) and the
update is ``p -= lr / (1 - b1^t) * m``. With exact averaging this is the same optimizer (``d`` is the
same on every rank and the average is linear); with a sparsifying reducer it changes what is
selected and what error feedback holds back: the entries largest in the units of the update
(``g / d``) instead of the largest raw gradients. Under Adam every coordinate moves by about the
same amount per step whatever its gradient's scale, so a top-k of the raw gradient starves the
coordinates with small gradients (those most amplified by ``1 / d``); selecting on ``g / d`` is what
1-bit Adam does in effect, since it compresses the momentum of the preconditioned stage.
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
                 freeze_after: int = 1, precondition: bool = False):
        if isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or freeze_after < 1:
            raise ValueError(f"FrozenVarianceAdamW: freeze_after must be an integer >= 1, got {freeze_after!r}")
        if not isinstance(precondition, bool):
            raise ValueError(f"FrozenVarianceAdamW: precondition must be True or False, got {precondition!r}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.freeze_after = freeze_after
        self.precondition = precondition
        self._hooks: list = []

    def _denominator(self, group, st) -> torch.Tensor:
        return (st["exp_avg_sq"].sqrt() / math.sqrt(1 - group["betas"][1] ** self.freeze_after)).add_(group["eps"])

    def _precondition_gradients(self, convert: bool) -> None:
        """Register the hooks that divide each parameter's incoming gradient by its frozen
        denominator; ``convert``: also bring the first moment into those units (once, at the freeze)."""
        if not self.precondition or self._hooks:
            return
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st or "exp_avg_sq" not in st:
                    continue
                d = self._denominator(group, st)
                if convert:
                    st["exp_avg"].div_(d)
                self._hooks.append(p.register_hook(lambda g, d=d: g / d))

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._steps_done() >= self.freeze_after:  # resumed after the freeze: moments already scaled
            self._precondition_gradients(convert=False)

    def _steps_done(self) -> int:
        return max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)

    @torch.no_grad()
    def step(self, closure=None):
        if self._steps_done() < self.freeze_after:
            loss = super().step(closure)
            if self._steps_done() >= self.freeze_after:
                self._precondition_gradients(convert=True)  # from the next backward on
            return loss
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
                    raise RuntimeError("FrozenVarianceAdamW does not support sparse gradients")
                st = self.state[p]
                if "exp_avg_sq" not in st:
                    raise RuntimeError("FrozenVarianceAdamW: a parameter received its first gradient after the "
                                       "second moment was frozen (it has no second moment to freeze)")
                st["step"] += 1
                t = int(st["step"])
                p.mul_(1 - lr * wd)
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                if self.precondition:  # gradient and moment already divided by the frozen denominator
                    p.add_(st["exp_avg"], alpha=-lr / (1 - b1 ** t))
                    continue
                denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1 ** t))
        return loss
