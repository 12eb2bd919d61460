"""AdamW fed the averaged momentum instead of the averaged gradient: error feedback on the momentum.

Why: under a sparse exchange of *gradients*, AdamW's first moment is built from the sparse, delayed
averaged gradient, and what a rank holds back reaches the momentum late and in bursts. 1-bit Adam
(Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021) and 0/1 Adam (Lu et al., ICLR 2023) instead run plain Adam for a warm-up, then
freeze the second moment ``v`` and communicate the error-compensated *momentum*: with ``v`` fixed
the update ``m / (sqrt(v) + eps)`` is linear in ``m``, and ``m`` is linear in the gradients, so
averaging the ranks' momenta is exact and error feedback on them loses nothing over time. For top-k
sparsification the local momentum is DGC's momentum correction (Lin et al., "Deep Gradient
Compression", ICLR 2018, §3.2): each rank keeps its velocity ``u_r = g_r + b1 u_r`` and feeds it to
the reducer's error feedback (:class:`sparsync.convergence.GradientPolicy` with ``momentum=b1``,
``masking=False``); the reducer's output is the (compressed) average velocity ``U``.

Contract of :class:`VelocityAdamW` (``p.grad`` at ``step()`` = the averaged velocity ``U_t``, the
sum ``sum_k b1^k g_{t-k}`` of averaged gradients):

* AdamW's first moment is ``m_t = (1 - b1) U_t`` exactly when ``U`` is exact (both recursions start
  at zero), so after the freeze the update is :class:`~sparsync.adam.FrozenVarianceAdamW`'s with
  ``m = (1 - b1) U``.
* Before the freeze (``freeze_after`` steps) the second moment needs the averaged gradient itself,
  recovered as ``g_t = U_t - b1 U_{t-1}``; this is exact only while the exchange is lossless, so the
  trainer requires ``dense_steps >= freeze_after`` (then these steps are AdamW's, up to float
  rounding of the difference). The previous velocity is kept in the parameter's state
  (``"velocity_prev"``, dropped at the freeze), so a checkpoint resumes bitwise.
* With density 1 it is FrozenVarianceAdamW on the averaged gradients, up to float rounding
  (tested); the state dict is AdamW's plus ``velocity_prev`` during the warm-up.
"""

from __future__ import annotations

import torch

from .adam import FrozenVarianceAdamW

__all__ = ["VelocityAdamW"]


class VelocityAdamW(FrozenVarianceAdamW):
    """:class:`~sparsync.adam.FrozenVarianceAdamW` whose input is the averaged velocity (module docstring).

    Args: as FrozenVarianceAdamW; ``betas[0]`` must be the momentum of the velocity fed to it.
    """

    @torch.no_grad()
    def step(self, closure=None):
        if self._steps_done() >= self.freeze_after:
            for st in self.state.values():
                st.pop("velocity_prev", None)
            return super().step(closure)
        # warm-up: AdamW on the recovered averaged gradients g_t = U_t - b1 U_{t-1}
        velocities = []
        for group in self.param_groups:
            b1 = group["betas"][0]
            for p in group["params"]:
                if p.grad is None:
                    continue
                u = p.grad
                prev = self.state[p].get("velocity_prev") if p in self.state else None
                velocities.append((p, u))
                p.grad = u.clone() if prev is None else torch.add(u, prev, alpha=-b1)
        loss = super().step(closure)
        for p, u in velocities:
            self.state[p]["velocity_prev"] = u.detach().clone()
            p.grad = u
        return loss

    def _first_moment(self, st: dict, grad: torch.Tensor, b1: float) -> None:
        """After the freeze: ``m = (1 - b1) U`` (``grad`` is the averaged velocity ``U``)."""
        torch.mul(grad, 1 - b1, out=st["exp_avg"])
