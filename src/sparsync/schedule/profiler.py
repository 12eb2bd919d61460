"""Per-tensor backward times ``t_b^(l)`` and the gradient-ready order.

PyTorch does not promise reverse-registration order, so the profiler records the order in which
post-accumulate-grad hooks fire; tensor ``k`` of that order gets ``t_b[k] = ready[k] - ready[k-1]``
(the first one measured from the start of backward, i.e. from when the gradient of the model's
output arrives). On CUDA every hook synchronises the device first (the paper's method: kernels of
different tensors may overlap, so only synchronised timestamps are attributable). Over several
profiled iterations the per-tensor median is taken; :meth:`BackwardProfile.broadcast` sends rank 0's
profile to every rank so all ranks compute the same plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BackwardProfile", "ProfileRecorder", "profile_module"]


@dataclass
class BackwardProfile:
    order: list[int]       # parameter indices in gradient-ready order
    t_b: list[float]       # seconds, one per entry of ``order``
    steps: int = 0

    def broadcast(self, comm, src: int = 0) -> BackwardProfile:
        if comm.world_size == 1:
            return self
        with comm.unrecorded():
            order = comm.broadcast(torch.tensor(self.order, dtype=torch.int64, device=comm.device), src)
            t_b = comm.broadcast(torch.tensor(self.t_b, dtype=torch.float64, device=comm.device), src)
        return BackwardProfile(order.cpu().tolist(), t_b.cpu().tolist(), self.steps)

    def to_dict(self) -> dict:
        return {"order": list(self.order), "t_b": list(self.t_b), "steps": self.steps}


class ProfileRecorder:
    """Collects (order, ready times) of several backward passes and reduces them to a profile."""

    def __init__(self, n_params: int):
        self.n = n_params
        self.samples: list[tuple[list[int], list[float]]] = []

    def add(self, start: float, order: list[int], ready: list[float]) -> None:
        """``ready[k]`` = perf_counter time at which ``order[k]``'s gradient was accumulated."""
        if len(order) != self.n:
            return  # unused parameters in this step: not a complete sample
        times = np.diff(np.asarray([start] + list(ready), dtype=np.float64))
        self.samples.append((list(order), np.maximum(times, 0.0).tolist()))

    def result(self) -> BackwardProfile:
        if not self.samples:
            raise RuntimeError("no complete backward pass was profiled (unused parameters in every step?)")
        # order: the most recent sample's order (orders are normally identical); times per parameter
        order = self.samples[-1][0]
        per_param = np.zeros((len(self.samples), self.n))
        for s, (o, t) in enumerate(self.samples):
            per_param[s, o] = t
        med = np.median(per_param, axis=0)
        return BackwardProfile(list(order), [float(med[i]) for i in order], len(self.samples))

    def state(self) -> list:
        return [list(map(list, s)) for s in self.samples]

    def load(self, samples) -> None:
        self.samples = [(list(o), list(t)) for o, t in samples]


def profile_module(module: torch.nn.Module, batch_fn, steps: int = 10,
                   warmup: int = 3) -> tuple[BackwardProfile, float]:
    """Profile a module on this process: returns (backward profile over trainable params, forward s).

    ``batch_fn()`` returns the scalar loss of one forward pass of ``module`` (it is timed as the
    forward time).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    rec = ProfileRecorder(len(params))
    cur = {"order": [], "ready": []}
    cuda = any(p.is_cuda for p in params)

    def hook(p):
        if cuda:
            torch.cuda.synchronize()
        cur["order"].append(index[id(p)])
        cur["ready"].append(time.perf_counter())

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    fwd = []
    try:
        for it in range(warmup + steps):
            module.zero_grad(set_to_none=True)
            cur["order"], cur["ready"] = [], []
            t0 = time.perf_counter()
            loss = batch_fn()
            if cuda:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            loss.backward()
            if it >= warmup:
                rec.add(t1, cur["order"], cur["ready"])
                fwd.append(t1 - t0)
    finally:
        for h in handles:
            h.remove()
        module.zero_grad(set_to_none=True)
    return rec.result(), float(np.median(fwd))
