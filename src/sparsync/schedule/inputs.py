"""One group's local input to its reducer: the gradients gathered, checked and passed through the policy.

Contract: :meth:`InputStage.build` returns what group ``g``'s reducer is fed this step - a coalesced
COO tensor on the sparse path (a reducer with ``sparse_input``), else the flat gradient after the
convergence policy - and records a non-finite local gradient in the step's record (``bad_local``:
the guard then decides for every rank alike, and the input is zeros). It reads declared
capabilities only: the policy's ``reads_parts`` / ``folds``
(:class:`sparsync.convergence.ConvergencePolicy`), the reducer's ``accepts_fold`` and
``indexed_output`` (:data:`sparsync.reducers.base.CAPABILITIES`).

Three paths: a policy with ``reads_parts`` (momentum correction, Lin et al., "Deep Gradient
Compression", ICLR 2018) reads the per-parameter gradients itself, so nothing is gathered first;
with ``folds`` and a reducer whose memory ``accepts_fold`` it adds its output into the reducer's
error-feedback memory in the same pass (``memory.fold_target`` / ``memory.mark_folded``). Otherwise
the gradients are gathered into the group's flat buffer (:meth:`.buffers.GradBuffers.gather`), checked
and handed to ``policy.before_reduce``.
"""

from __future__ import annotations

import torch

from .guards import all_finite

__all__ = ["InputStage"]


class InputStage:
    """The input side of the overlap engine (see the module docstring); state-free between steps."""

    def __init__(self, params, numels, buffers, guard, policy, sparse_path):
        self.params = params
        self.numels = numels
        self.buffers = buffers
        self.guard = guard
        self.policy = policy
        self.sparse_path = sparse_path

    def build(self, rec, g, idx, grads, r, span, own=False):
        """Group ``g``'s input (parameters ``idx``, gradients ``grads``, reducer ``r``). ``own``:
        never the ``.grad`` buffer itself (``delay=1`` writes that buffer while the input is being
        reduced)."""
        if len(idx) == 1 and idx[0] in self.sparse_path:
            x = self._sparse(rec, g, self.params[idx[0]], grads[0])
            span.mark("check")
            return x
        return self._dense(rec, g, idx, grads, r, span, own=own)

    def _dense(self, rec, g, idx, grads, r, span, own=False):
        """The flat gradient as the reducer should see it (policy applied); the gradients are gathered
        into the input-only buffer when the reducer returns an ``IndexedSum`` or when ``own`` is set,
        so the ``.grad`` buffer stays cheap to clear, or free to be written."""
        policy = self.policy
        if policy is not None and policy.reads_parts:
            span.mark("copy")
            if self.guard.checks and not all(all_finite(gr) for gr in grads if gr is not None):
                rec.bad_local.append(g)
                grads = [None] * len(grads)
            span.mark("check")
            numels, like = [self.numels[i] for i in idx], self.params[idx[0]]
            target = None  # the reducer's memory buffer, when the policy can add its output there in its own pass
            if policy.folds and r.accepts_fold:
                target = r.memory.fold_target(sum(numels), like.dtype, like.device)
            if target is None:
                x = policy.before_reduce_parts(g, grads, numels, like, r)
            else:
                x = policy.before_reduce_parts(g, grads, numels, like, r, fold_into=target)
                r.memory.mark_folded()
            span.mark("policy")
            return x
        keep = own or r.indexed_output
        x, copied = self.buffers.gather(g, grads, keep_output=keep, always_copy=own)
        rec.stats.copied_bytes += copied
        span.mark("copy")
        if self.guard.checks and not all_finite(x):
            rec.bad_local.append(g)
            x.zero_()
        span.mark("check")
        if policy is not None:
            x = policy.before_reduce(g, x, r)
            span.mark("policy")
        return x

    def _sparse(self, rec, g, p, gr):
        x = _empty_coo(p) if gr is None else (gr if gr.is_sparse else gr.to_sparse(1)).coalesce()
        if self.guard.checks and not bool(torch.isfinite(x._values()).all()):
            rec.bad_local.append(g)
            x = _empty_coo(p)
        return x


def _empty_coo(p):
    """An all-zero gradient in the embedding layout (hybrid COO, one sparse dimension)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=p.device),
                                   torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device), p.shape,
                                   check_invariants=True, is_coalesced=True)
