"""Error-feedback memory: the residual a reducer keeps between steps, as a mixin of :class:`~.base.Reducer`.

Contract (local error feedback, Seide et al., "1-bit SGD", 2014; Stich et al., "Sparsified SGD with
memory", NeurIPS 2018): at every step a reducer calls :meth:`BufferedAccumulator.accumulate` once,
which returns ``acc = grad + residual``, and then hands ``acc`` back with what it sent
(:meth:`~.base.Reducer.take_unsent` / :meth:`~.base.Reducer.keep_unsent`), which leaves
``residual = acc - sent`` - so ``sum of inputs == sum of sent + residual`` holds every step
(bitwise with fp32 values; with half-precision values the rounding error stays in the residual).

This module adds to the base class's one-tensor-per-step ``accumulate``:

* the in-place form (``reuse_buffers=True``): the residual tensor itself becomes ``acc``;
* the checked two-buffer form: with the input check on, ``acc`` is written into a second buffer by
  :meth:`~.base.Reducer.sum_checked` and the two buffers swap roles every step;
* the folding buffer: a caller that computes its input in a pass of its own (momentum correction,
  :func:`sparsync.native.momentum_fold`) may add it into the residual itself
  (:meth:`BufferedAccumulator.folding_buffer`, :meth:`BufferedAccumulator.mark_folded`); the next
  ``accumulate`` then returns the residual unchanged.

It selects nothing and sends nothing: it is not a reducer (the registry skips this module), and
every reducer with a residual (micro, hard_threshold, topka, topkdsa, gtopk, oktopk, cltk) mixes it in.
"""

from __future__ import annotations

import torch

__all__ = ["BufferedAccumulator"]


class BufferedAccumulator:
    """Mixin: ``acc = grad + residual`` without a fresh allocation (option ``reuse_buffers``).

    ``reuse_buffers=True``: the residual tensor itself becomes the accumulator,
    ``residual.add_(grad)`` - no allocation (no page faults on a fresh gradient-sized tensor) and no
    third array (an in-place add writes back where it read). So ``r.residual`` of step ``t`` is
    overwritten by step ``t + 1``: clone it to keep it. ``False``: a new tensor ``grad + residual``
    every step (the base class's :meth:`~sparsync.reducers.base.Reducer.accumulate`).

    With the input check on (``nonfinite="error"``) the check rides on this pass instead of a read
    pass of its own: ``acc = grad + residual`` is written by
    :meth:`~sparsync.reducers.base.Reducer.sum_checked` (streaming stores) into a second buffer, and
    the two buffers swap roles every step - one more gradient-sized buffer per reducer, so a residual
    tensor taken from ``r.residual`` is then overwritten two steps later. The in-place add could not
    take the check: on a NaN found half-way the residual would already hold half of the gradient,
    and ``(r + g) - g`` is not ``r`` in floating point; here the residual is unchanged when it raises.
    SparseDDP checks its gradients itself (``nonfinite="ignore"``) and keeps the one buffer.
    The timings behind these choices: ``docs/micro.md``, "Performance" (error feedback in one pass).
    """

    reuse_buffers = True
    checks_input = True  # every user of this mixin calls accumulate() first, which checks the input
    _folded: int | None = None  # data_ptr of a residual a caller already added this step's input into
    _spare: torch.Tensor | None = None  # the second accumulator buffer of the checked path

    def accumulate(self, grad: torch.Tensor) -> torch.Tensor:
        res = self.residual
        folded, self._folded = self._folded, None
        if folded is not None and res is not None and grad.data_ptr() == folded == res.data_ptr():
            self.check_finite(res)
            return res  # the caller did ``residual += input`` itself (mark_folded)
        if res is None:
            return self.sum_checked(torch.empty_like(grad, memory_format=torch.contiguous_format), grad, None)
        if (not self.reuse_buffers or res.shape != grad.shape or res.dtype != torch.result_type(grad, res)
                or res.device != grad.device or res.data_ptr() == grad.data_ptr()):
            return super().accumulate(grad)  # a new tensor, the sum checked (residual overflow too)
        if self.nonfinite != "ignore":  # the C kernel, or torch's add and a check of the sum
            spare = self._spare
            if (spare is None or spare.shape != res.shape or spare.dtype != res.dtype or spare.device != res.device
                    or spare.untyped_storage().data_ptr() in (res.untyped_storage().data_ptr(),
                                                              grad.untyped_storage().data_ptr())):
                spare = torch.empty_like(res, memory_format=torch.contiguous_format)
            self.sum_checked(spare, grad, res)  # raises before anything is sent; res unchanged then
            self._spare = res
            return spare
        self.check_finite(grad)  # nothing to do with nonfinite="ignore"
        return res.add_(grad)

    def folding_buffer(self, numel: int, dtype, device) -> torch.Tensor | None:
        """The residual, when the next :meth:`accumulate` of a ``(numel,)`` ``dtype`` tensor would add
        into it in place (else None: first step, ``reuse_buffers=False``, another shape). A caller that
        computes its input in a pass of its own may add it there in the same pass and then pass the
        residual itself to ``reduce``, after :meth:`mark_folded` - one pass over the gradient fewer
        (SparseDDP's momentum correction, :func:`sparsync.native.momentum_fold`)."""
        res = self.residual
        if (res is None or not self.reuse_buffers or res.dim() != 1 or res.numel() != numel or res.dtype != dtype
                or res.device != device):
            return None
        return res

    def mark_folded(self, buf: torch.Tensor) -> None:
        """The next ``reduce`` gets ``buf`` (:meth:`folding_buffer`), which already holds ``residual + input``."""
        self._folded = buf.data_ptr()

    def _forget_buffers(self) -> None:
        self._spare = None
