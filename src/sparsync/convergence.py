"""Convergence at low density: a :class:`GradientPolicy` that every sparse reducer can use.

At 1% density plain error feedback needs more steps than dense training to reach the same accuracy.
Deep Gradient Compression (DGC; Lin, Han, Mao, Wang, Dally,
"Deep Gradient Compression: Reducing the Communication Bandwidth for Distributed Training",
ICLR 2018, §3.2-§3.3) closes most of that gap with four local techniques, none of which sends an
extra byte. They are implemented here, per merge group, around ``reducer.reduce``::

    policy = ss.GradientPolicy(momentum=0.9, masking=True, warmup_steps=50, warmup_start=0.25, clip=1.0)
    ddp = ss.SparseDDP(model, comm, reducer="micro", density=0.01, policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=lr)       # momentum now lives in the policy

* **Momentum correction** (DGC §3.2, eq. 6-7): with momentum SGD, the momentum is accumulated
  *locally, before sparsification* — ``u = m u + g`` — and the reducer's error feedback then
  accumulates the velocity ``u`` instead of the raw gradient (``v = v + u``, its residual). The
  optimizer must then be plain SGD with the same learning rate (``sparsync train`` does that
  switch itself). With ``density = 1`` and no masking this is exactly momentum SGD.
* **Nesterov momentum correction** (DGC §3.2, the paragraph after eq. 7, which extends the
  correction to Nesterov momentum; Sutskever et al., ICML 2013): ``u = m u + g`` as above, and the
  reducer accumulates the look-ahead update ``n = g + m u`` instead of ``u`` (``v = v + n``). With
  ``density = 1`` and no masking this is exactly ``torch.optim.SGD(momentum=m, nesterov=True)``,
  whose update is ``g + m buf`` with ``buf = m buf + g``. Standing alone it costs one more pass over
  the group than plain momentum correction (``n`` goes through a buffer kept per group); in
  SparseDDP, with a reducer whose memory accepts a fold (``accepts_fold``), the velocity update and
  the residual's accumulation are one pass either way (``fold_into``,
  :func:`sparsync.native.momentum_fold`).
* **Momentum-factor masking** (DGC §3.3): the velocity of the entries that were sent is cleared,
  ``u = u ⊙ ¬mask``, so stale momentum does not keep pushing a coordinate whose accumulated update was
  just applied. "Sent" = the reducer's residual is exactly zero there after the reduce (what every
  conserving top-k reducer leaves for a transmitted entry; for a reducer with no residual, e.g.
  ``dense``, everything counts as sent, which makes momentum correction + masking plain SGD). With
  half-precision values on the wire (``value_dtype``) a sent entry keeps its rounding error in the
  residual, so masking then clears only the entries whose value was exact in fp16/bf16.
* **Density warm-up** (DGC §3.3, "warm-up training"): the density decays exponentially from
  ``warmup_start`` to the target over the first ``warmup_steps`` optimizer steps,
  ``d(t) = s (d/s)^(t/T)``, so the first, fast-changing gradients are not held back for long
  (this sends more in those first steps, and nothing extra afterwards).
* **Dense warm-up** (``dense_steps``): density 1 (everything sent) for the first ``dense_steps``
  optimizer steps, then the schedule above. The uncompressed start of 1-bit Adam (Tang et al. 2021,
  its "warm-up stage") and of PowerSGD in torch (``start_powerSGD_iter``, Vogels et al. 2019): the
  first gradients change fastest and, under Adam, build the second-moment estimate that later steps
  are scaled by.
* **Local gradient clipping** (DGC §3.3): each rank clips its group gradient to norm
  ``clip / sqrt(P)`` *before* it is added to the velocity / residual (summing P independent
  gradients multiplies the norm by about sqrt(P), hence the scaling). Clipping is per merge group,
  so with ``merge="single"`` it is global norm clipping.

Conservation, extended to the velocity (the identity of :mod:`sparsync.reducers.base`, with ``u'``
the velocity fed to the reducer)::

    u'_r = m u_r + g_r                                   (momentum correction)
    f_r  = u'_r,  or  g_r + m u'_r  with nesterov        (what the reducer is fed)
    sum_r (f_r + residual_before_r) == out + sum_r residual_after_r      (the reducer's identity)
    u_r(next) = u'_r ⊙ [residual_after_r != 0]   with masking,   u'_r   without

so, without masking, nothing of any rank's velocity is lost: over T steps the sum of all outputs
plus the final residuals equals the sum over steps and ranks of what was fed. With masking, exactly
the masked velocity entries are dropped.

Every decision is a function of the step number and of rank-local data only, so parameters stay
bitwise identical across ranks (the reducer's output is), and :meth:`state_dict` holds the
velocities so a resumed run continues bitwise.

The engine's side is :class:`ConvergencePolicy`, a base class with declared capabilities and no-op
defaults: :meth:`~ConvergencePolicy.density` before each step's reductions,
:meth:`~ConvergencePolicy.before_reduce` (or, with ``reads_parts``,
:meth:`~ConvergencePolicy.before_reduce_parts`, folding into the reducer's memory when ``folds``) and
:meth:`~ConvergencePolicy.after_reduce` around each group's ``reducer.reduce``, and
:meth:`~ConvergencePolicy.on_regroup` when the engine changes its merge plan.
"""

from __future__ import annotations

import math

import torch

from . import native

__all__ = ["ConvergencePolicy", "GradientPolicy", "policy_from_options", "POLICY_OPTIONS"]

#: option names accepted by :func:`policy_from_options` (``sparsync train --convergence``)
POLICY_OPTIONS = ("momentum", "masking", "warmup_steps", "warmup_start", "clip", "nesterov", "dense_steps")


class ConvergencePolicy:
    """What the overlap engine calls around each group's reduce; subclass it and override what you need.

    Declared capabilities (read by the engine as attributes; ``bool``):

    * ``reads_parts``: the engine hands :meth:`before_reduce_parts` the per-parameter gradients
      instead of gathering them into a flat buffer and calling :meth:`before_reduce`;
    * ``folds``: :meth:`before_reduce_parts` accepts ``fold_into`` - the reducer's memory buffer
      (``reducer.memory.fold_target``, for reducers with ``accepts_fold``) into which it adds its
      output in the same pass, after which the engine calls ``reducer.memory.mark_folded()``.
    """

    reads_parts = False
    folds = False

    def density(self, step: int, target: float) -> float:
        """The density for optimizer step ``step`` (default: the target)."""
        return target

    def before_reduce(self, key: int, grad: torch.Tensor, reducer) -> torch.Tensor:
        """What group ``key``'s reducer should be fed, from its flat gradient (default: unchanged)."""
        return grad

    def before_reduce_parts(self, key: int, grads, numels, like: torch.Tensor, reducer=None,
                            fold_into: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`before_reduce` from the group's per-parameter gradients (needs ``reads_parts``)."""
        raise NotImplementedError(f"{type(self).__name__} declares reads_parts but has no before_reduce_parts")

    def after_reduce(self, key: int, reducer) -> None:
        """Called after group ``key``'s reduce (default: nothing)."""

    def on_regroup(self, old_groups, new_groups, numels) -> None:
        """The engine changed its merge plan (groups are lists of parameter indices; default: nothing)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


class GradientPolicy(ConvergencePolicy):
    """DGC's local techniques around each group's reduce (see the module docstring).

    Args:
        momentum: momentum factor ``m`` for momentum correction; 0 turns it off (default).
        masking: momentum-factor masking (clear the velocity of sent entries); default: on
            whenever ``momentum > 0``.
        warmup_steps: length ``T`` of the exponential density warm-up in optimizer steps (0: off).
        warmup_start: density ``s`` at step 0 of the warm-up (must be in (0, 1]).
        clip: local gradient-norm clipping threshold before accumulation (None: off); the per-rank
            threshold is ``clip / sqrt(P)``.
        nesterov: Nesterov momentum correction (the reducer is fed ``g + m u``; needs ``momentum > 0``).
        dense_steps: density 1 for the first ``dense_steps`` optimizer steps (0: off).
    """

    def __init__(self, momentum: float = 0.0, masking: bool | None = None, warmup_steps: int = 0,
                 warmup_start: float = 0.25, clip: float | None = None, nesterov: bool = False,
                 dense_steps: int = 0):
        momentum = float(momentum)
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"GradientPolicy: momentum must be in [0, 1), got {momentum}")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"GradientPolicy: warmup_steps must be a non-negative integer, got {warmup_steps!r}")
        if not isinstance(dense_steps, int) or isinstance(dense_steps, bool) or dense_steps < 0:
            raise ValueError(f"GradientPolicy: dense_steps must be a non-negative integer, got {dense_steps!r}")
        self.dense_steps = dense_steps
        warmup_start = float(warmup_start)
        if not (0.0 < warmup_start <= 1.0):
            raise ValueError(f"GradientPolicy: warmup_start must be in (0, 1], got {warmup_start}")
        if clip is not None:
            clip = float(clip)
            if not (clip > 0 and math.isfinite(clip)):
                raise ValueError(f"GradientPolicy: clip must be a positive number, got {clip}")
        if masking is None:
            masking = momentum > 0
        if masking and momentum == 0:
            raise ValueError("GradientPolicy: masking=True needs momentum > 0 (it masks the velocity)")
        if not isinstance(nesterov, bool):
            raise ValueError(f"GradientPolicy: nesterov must be True or False, got {nesterov!r}")
        if nesterov and momentum == 0:
            raise ValueError("GradientPolicy: nesterov=True needs momentum > 0 (it is a form of momentum correction)")
        self.nesterov = nesterov
        self._lookahead: dict[int, torch.Tensor] = {}  # nesterov: per-group buffer for g + m u
        self.momentum = momentum
        self.masking = bool(masking)
        self.warmup_steps = warmup_steps
        self.warmup_start = warmup_start
        self.clip = clip
        self.velocity: dict[int, torch.Tensor] = {}

    def options(self) -> dict:
        """The configuration (what ``state_dict`` checks on load)."""
        return {"momentum": self.momentum, "masking": self.masking, "warmup_steps": self.warmup_steps,
                "warmup_start": self.warmup_start, "clip": self.clip, "nesterov": self.nesterov,
                "dense_steps": self.dense_steps}

    def __repr__(self) -> str:
        return "GradientPolicy(" + ", ".join(f"{k}={v!r}" for k, v in self.options().items()) + ")"

    # ------------------------------------------------------------------ the protocol
    def density(self, step: int, target: float) -> float:
        """1 for ``t < dense_steps``; exponential warm-up ``s (d/s)^(t/T)`` for ``t < T`` (never below
        the target); then ``d``."""
        if step < self.dense_steps:
            return 1.0
        s, T = self.warmup_start, self.warmup_steps
        if T == 0 or step >= T or s <= target:
            return target
        return max(target, min(1.0, s * (target / s) ** (step / T)))

    def before_reduce(self, key: int, grad: torch.Tensor, reducer) -> torch.Tensor:
        """Clip ``grad`` (local clipping), then fold it into the velocity (momentum correction);
        returns what the reducer should accumulate. The flat gradient is the one-part case of
        :meth:`before_reduce_parts`."""
        if self.momentum > 0:
            return self.before_reduce_parts(key, [grad], [grad.numel()], grad, reducer)
        scale = self._clip_scale([grad], reducer)
        return grad if scale is None else grad.mul_(scale)

    @property
    def reads_parts(self) -> bool:
        """True when :meth:`before_reduce_parts` saves a pass: with momentum correction the
        velocity update reads each parameter's gradient where autograd left it, so the engine
        skips gathering the gradients into a flat buffer first (one copy of the group per step)."""
        return self.momentum > 0

    @property
    def folds(self) -> bool:
        """True when :meth:`before_reduce_parts` takes ``fold_into`` (momentum correction on)."""
        return self.momentum > 0

    def before_reduce_parts(self, key: int, grads, numels, like: torch.Tensor, reducer=None,
                            fold_into: torch.Tensor | None = None) -> torch.Tensor:
        """Momentum correction on the group's gradients as separate tensors (``None``: zero), laid
        out one after the other (``numels``; ``like`` gives dtype and device): ``u = c g + m u``
        slice by slice of the flat velocity, ``c`` the local-clipping factor (1 when not clipped),
        so the engine need not copy the gradients into a flat buffer first.

        ``fold_into``: the reducer's memory buffer (:meth:`~sparsync.reducers.memory.ErrorFeedback.fold_target`);
        what the reducer would accumulate (``u``, or Nesterov's ``g + m u``) is added into it in the
        same pass (:func:`sparsync.native.momentum_fold`: one pass instead of two, or three with
        Nesterov; the same bits) and it is returned, for ``reduce`` after ``memory.mark_folded()``."""
        u = self.velocity.get(key)
        n = sum(numels)
        if u is None:
            u = self.velocity[key] = torch.zeros(n, dtype=like.dtype, device=like.device)
        elif u.numel() != n or u.dtype != like.dtype:
            raise ValueError(f"GradientPolicy: group {key} changed from {tuple(u.shape)} {u.dtype} to "
                             f"({n},) {like.dtype}; a policy belongs to one merge plan")
        elif u.device != like.device:  # loaded from a checkpoint (kept on the CPU)
            u = self.velocity[key] = u.to(like.device)
        scale = self._clip_scale(grads, reducer)
        if fold_into is not None:
            return self._fold(u, fold_into, grads, numels, scale)
        la = self._lookahead_buffer(key, u) if self.nesterov else None
        off = 0
        for gr, m in zip(grads, numels):
            ui = u[off:off + m]
            ni = None if la is None else la[off:off + m]
            off += m
            if gr is None:
                ui.mul_(self.momentum)  # m u + 0
                if ni is not None:
                    torch.mul(ui, self.momentum, out=ni)  # 0 + m u
                continue
            gi = gr.reshape(-1)
            if scale is not None:
                gi = gi * scale
            torch.add(gi, ui, alpha=self.momentum, out=ui)  # u = g + m u in one pass
            if ni is not None:
                torch.add(gi, ui, alpha=self.momentum, out=ni)  # nesterov: n = g + m u (one more pass)
        return u if la is None else la

    def _fold(self, u: torch.Tensor, r: torch.Tensor, grads, numels, scale) -> torch.Tensor:
        """``u = c g + m u`` and ``r += u`` (Nesterov: ``r += c g + m u``) slice by slice: the C kernel
        in one pass where it applies, else torch's passes (the same operations, so the same bits)."""
        if r.shape != u.shape or r.dtype != u.dtype or r.device != u.device:
            raise ValueError(f"GradientPolicy: fold_into must be like the velocity {tuple(u.shape)} {u.dtype} "
                             f"on {u.device}, got {tuple(r.shape)} {r.dtype} on {r.device}")
        m, off = self.momentum, 0
        for gr, k in zip(grads, numels):
            ui, ri = u[off:off + k], r[off:off + k]
            off += k
            gi = None if gr is None else gr.reshape(-1)
            if gi is not None and scale is not None:
                gi = gi * scale
            if native.usable(ui) and native.usable(ri) and (gi is None or native.usable(gi)):
                native.momentum_fold(ui, ri, gi, m, self.nesterov)
                continue
            if gi is None:
                ui.mul_(m)
                ri.add_(ui * m if self.nesterov else ui)
            else:
                torch.add(gi, ui, alpha=m, out=ui)
                ri.add_(torch.add(gi, ui, alpha=m) if self.nesterov else ui)
        return r

    def _lookahead_buffer(self, key: int, u: torch.Tensor) -> torch.Tensor:
        """The group's buffer for Nesterov's ``g + m u`` (allocated once, like the velocity). The
        reducer accumulates it into its residual during the reduce, before the next step writes it."""
        la = self._lookahead.get(key)
        if la is None or la.shape != u.shape or la.dtype != u.dtype or la.device != u.device:
            la = self._lookahead[key] = torch.empty_like(u)
        return la

    def _clip_scale(self, grads, reducer) -> float | None:
        """Local clipping: the factor that brings the gradients' joint norm to ``clip / sqrt(P)``
        (torch.nn.utils.clip_grad_norm_'s coefficient), or None when no clipping is needed."""
        if self.clip is None:
            return None
        P = 1 if reducer is None else max(1, int(reducer.comm.world_size))
        limit = self.clip / math.sqrt(P)
        norms = [torch.linalg.vector_norm(gr.reshape(-1)) for gr in grads if gr is not None]
        if not norms:
            return None
        norm = float(norms[0]) if len(norms) == 1 else float(torch.linalg.vector_norm(torch.stack(norms)))
        return limit / (norm + 1e-6) if norm > limit else None

    def after_reduce(self, key: int, reducer) -> None:
        """Momentum-factor masking: clear the velocity where the residual is zero (entry sent)."""
        if not self.masking:
            return
        u = self.velocity.get(key)
        if u is None:
            return
        res = reducer.residual  # None for a reducer without memory: everything was sent
        if res is None:
            u.zero_()
        else:
            u.masked_fill_(res.reshape(u.shape) == 0, 0)

    def on_regroup(self, old_groups, new_groups, numels) -> None:
        """The engine changed its merge plan (``mgwfbp``/``optimal`` after profiling): carry every
        parameter's velocity from its old group to its new one (groups are lists of parameter
        indices, laid out in that order; ``numels[i]`` = size of parameter ``i``)."""
        if not self.velocity:
            return
        pieces = {}
        for key, u in self.velocity.items():
            idx = list(old_groups[key])
            for i, piece in zip(idx, torch.split(u, [numels[i] for i in idx])):
                pieces[i] = piece
        new = {}
        for key, idx in enumerate(new_groups):
            if any(i in pieces for i in idx):
                like = next(pieces[i] for i in idx if i in pieces)
                new[key] = torch.cat([pieces[i] if i in pieces else like.new_zeros(numels[i]) for i in idx])
        self.velocity = new

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"options": self.options(),
                "velocity": {int(k): v.detach().cpu().clone() for k, v in self.velocity.items()}}

    def load_state_dict(self, d: dict) -> None:
        if not isinstance(d, dict) or "options" not in d or "velocity" not in d:
            raise ValueError("GradientPolicy.load_state_dict expects the dict returned by state_dict()")
        saved = {"nesterov": False, "dense_steps": 0, **d["options"]}  # states saved before the options existed
        if saved != self.options():
            diff = sorted(k for k, v in self.options().items() if saved.get(k) != v)
            raise ValueError(f"GradientPolicy: saved state has different options ({', '.join(diff)}: "
                             f"saved {[saved.get(k) for k in diff]}, now {[self.options()[k] for k in diff]})")
        self.velocity = {int(k): v.clone() for k, v in d["velocity"].items()}


def policy_from_options(opts: dict | None) -> GradientPolicy | None:
    """``{"momentum": 0.9, "warmup_steps": 50, ...}`` -> a policy; None or ``{}`` -> None.

    Unknown keys raise ``ValueError`` naming them and the valid ones.
    """
    if not opts:
        return None
    bad = sorted(set(opts) - set(POLICY_OPTIONS))
    if bad:
        raise ValueError(f"unknown convergence option(s) {', '.join(bad)}; valid: {', '.join(POLICY_OPTIONS)}")
    return GradientPolicy(**opts)
