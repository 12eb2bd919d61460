"""Error feedback as one component: :class:`ErrorFeedback`, the residual a reducer keeps between steps.

Contract (local error feedback: Seide et al., "1-Bit Stochastic Gradient Descent and its Application
to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014; Stich, Cordonnier & Jaggi,
"Sparsified SGD with Memory", NeurIPS 2018; Lin et al., "Deep Gradient Compression", ICLR 2018). A
reducer owns one ``ErrorFeedback`` (``reducer.memory``; ``reducer.residual`` is its residual) and
calls it every step::

    acc = memory.add(grad)                  # acc = grad + decay * residual (decay 1 unless given), one
                                            #     pass, the input check fused in
    vals, sent = memory.take(acc, idx)      # what travels at idx; the residual keeps acc - sent there
    memory.keep(acc, idx, sent)             # or: the residual becomes acc minus what was sent at idx
    memory.keep(acc)                        # or: the residual is acc as it is (nothing sent)
    memory.put_back(idx, vals)              # then, after a re-selection: residual[idx] += vals (taken
                                            #     entries not sent in the end, received ones dropped here)
    memory.hold(idx, vals)                  # or: residual[idx] = vals (what a collective left here)

so that ``sum of inputs == sum of sent + residual`` holds every step, bitwise with fp32 values (with
half-precision values on the wire the rounding error ``acc - float(sent)``, exact in fp32, stays in
the residual). The memory selects nothing and sends nothing (GRACE's split of compressor, memory and
communicator: Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
Learning", ICDCS 2021); it is owned by the reducer because several collectives re-select or drop
entries after the local selection (gTop-k's and Ok-Topk's put-back, SparDL's global residual
collection), and only the reducer knows what was finally sent. The reducer therefore tells the memory
what was sent and what came back, as indices and values (:meth:`ErrorFeedback.keep`,
:meth:`~ErrorFeedback.put_back`, :meth:`~ErrorFeedback.hold`), and every write into a residual
happens in this module: no reducer computes a residual itself (a test greps for it). Each of these
calls costs ``O(len(idx))``, never a pass over the ``n`` entries; :meth:`ErrorFeedback.drain` (a
residual assigned from outside, added once) costs one pass when there is one, none otherwise.

Buffers, by the reducer's choice at construction (``in_place``):

* ``in_place=False``: ``add`` returns a new tensor every step; a residual taken from ``r.residual``
  stays valid.
* ``in_place=True`` without the input check: the residual tensor itself becomes ``acc``
  (``residual.add_(grad)``: no allocation, no third array), so ``r.residual`` of step ``t`` is
  overwritten by step ``t + 1``.
* ``in_place=True`` with the input check: ``acc`` is written into a second buffer by
  :func:`sum_checked` and the two buffers swap roles every step (the in-place add could not take the
  check: on a NaN found half-way the residual would hold half of the gradient; here it is unchanged
  when the check raises). A residual taken from ``r.residual`` is overwritten two steps later.
* :meth:`ErrorFeedback.add` with ``padded=m``: ``acc`` zero-padded to ``m`` entries, in one of two
  alternating work buffers (SparDL's block layout).

Fold (momentum correction in one pass, DGC §3.2): a caller that computes the reducer's input in a
pass of its own may add it into the residual in that pass: :meth:`ErrorFeedback.fold_target` gives
the buffer (the residual, when the next ``add`` would add into it in place), the caller adds its
input there and calls :meth:`ErrorFeedback.mark_folded`; the next ``add``, which must get that
buffer, then returns it after the input check instead of adding again. The state is an explicit
flag, cleared by that ``add`` and by any assignment of the residual.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import native
from ..sparse import add_at, set_at

__all__ = ["ErrorFeedback", "check_decay", "decay_memory", "sum_checked", "sums_finite", "cpu_copy", "placed"]

#: ``on_nonfinite(values, residual)``: raises for a non-finite input (``residual``: the memory whose
#: sum with finite ``values`` overflowed, or None)
NonfiniteHandler = Callable[[torch.Tensor, "torch.Tensor | None"], None]


def sums_finite(x: torch.Tensor) -> bool:
    """True when every entry of ``x`` is finite: one read pass (the sum of finite values is finite
    unless it overflows), and the exact ``isfinite(x).all()`` only for a non-finite sum."""
    return x.numel() == 0 or bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def sum_checked(out: torch.Tensor, grad: torch.Tensor, residual: torch.Tensor | None,
                on_nonfinite: NonfiniteHandler | None, decay: float = 1.0) -> torch.Tensor:
    """``out = grad + residual`` (``residual=None``: a copy of ``grad``), with the finite check of the
    SUM when ``on_nonfinite`` is given - a non-finite ``grad`` makes it non-finite, and so does a
    finite one that overflows the residual - in ONE pass where the C kernels can
    (:func:`sparsync.native.sum_check`: fp32 CPU, streaming stores), else torch's add and a check of
    ``out``. ``out`` must not overlap ``grad`` or ``residual``: when ``on_nonfinite`` raises, neither
    has changed and nothing was sent. Bits: those of ``torch.add(grad, residual, out=out)``.
    ``decay`` != 1: ``out = grad + decay * residual`` (``torch.add(..., alpha=decay)``, still one
    pass; the C kernel adds undecayed only, so torch's add and a check of ``out``)."""
    if (on_nonfinite is not None and decay == 1.0 and native.usable(out) and native.usable(grad)
            and (residual is None or native.usable(residual))):
        if not native.sum_check(out, residual, grad):
            on_nonfinite(grad, residual)
        return out
    if residual is None:
        out = out.copy_(grad)
    elif decay == 1.0:
        out = torch.add(grad, residual, out=out)
    else:
        out = torch.add(grad, residual, alpha=decay, out=out)
    if on_nonfinite is not None and not sums_finite(out):
        on_nonfinite(grad, residual)
    return out


def nonfinite_sum_count(values: torch.Tensor, residual: torch.Tensor) -> int:
    """How many entries of ``values + residual`` are not finite (an error message's count; one pass)."""
    return int((~torch.isfinite(values + residual)).sum())


def round_to_wire(vals: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.Tensor:
    """``vals`` as they travel: rounded to ``wire_dtype`` (fp16 saturates at +-65504), or unchanged
    (``None``, or already that dtype)."""
    if wire_dtype is None or vals.dtype == wire_dtype:
        return vals
    sent = vals.to(wire_dtype)
    if wire_dtype == torch.float16:  # the cast's infinities back to the largest finite value, in place on the
        # half-size result: the bits of clamping first, without a full-precision temporary (NaN stays NaN)
        sent.clamp_(-_FP16_MAX, _FP16_MAX)
    return sent


_FP16_MAX = 65504.0  # largest finite float16: larger magnitudes are sent saturated, the rest kept


def check_decay(decay, who: str = "") -> float:
    """``ef_decay`` as a float in (0, 1], or a one-line ``ValueError`` (``who``: the reducer's name)."""
    ok = isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0.0 < float(decay) <= 1.0
    if not ok:
        raise ValueError(f"{who + ': ' if who else ''}ef_decay must be in (0, 1], got {decay!r}")
    return float(decay)


def decay_memory(memory: ErrorFeedback, ef_decay, who: str) -> float:
    """A reducer's option ``ef_decay`` (SparseLoCo's decayed error feedback; 1: plain): checked
    (:func:`check_decay`), set on its ``memory``, and returned for the reducer to keep."""
    memory.decay = check_decay(ef_decay, who)
    return memory.decay


def cpu_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached CPU copy (for a state dict), or None."""
    return None if t is None else t.detach().cpu().clone()


def placed(part: torch.Tensor, lo: int, numel: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """A residual of ``numel`` entries read as one vector: ``base`` (a copy; None: zeros) plus ``part``
    added at ``lo`` (a reducer whose error feedback lives on a shard, with a residual assigned from
    outside beside it). A new tensor: neither input changes."""
    full = torch.zeros(numel, dtype=part.dtype, device=part.device) if base is None else base.clone()
    full[lo:lo + part.numel()] += part
    return full


def _shares_storage(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class ErrorFeedback:
    """The residual of one reducer and its work buffers (see the module docstring).

    Args:
        decay: ``ef_decay``, the factor on the residual before it is added (``acc = decay * residual +
            grad``; 1: plain error feedback, bit for bit; < 1: SparseLoCo's decayed feedback, Sarfi et
            al. 2025), in the same single pass and the same buffers (torch's ``add`` with ``alpha``: the
            C kernel of :func:`sum_checked` adds undecayed only); no fold (:meth:`fold_target` is None).
        in_place: accumulate into recycled buffers (the residual's own, or two alternating ones with
            the input check) instead of a new tensor per step.
        wire_dtype: dtype of the values on the wire (None: the accumulator's own); :meth:`take`
            rounds to it and the rounding error stays in the residual.
        on_nonfinite: the input check, called with ``(grad, residual)`` when ``grad + residual`` is
            not finite (it raises); None: no check (the caller guarantees finite input).
    """

    def __init__(self, *, in_place: bool = False, wire_dtype: torch.dtype | None = None,
                 on_nonfinite: NonfiniteHandler | None = None, decay: float = 1.0):
        self.decay = check_decay(decay)
        self.in_place = bool(in_place)
        self.wire_dtype = wire_dtype
        self.on_nonfinite = on_nonfinite
        self._residual: torch.Tensor | None = None
        self._folded = False  # the residual already holds residual + this step's input (mark_folded)
        self._spare: torch.Tensor | None = None  # the second buffer of the checked in-place form
        self._padded: list[torch.Tensor | None] = [None, None]  # add(padded=...)'s two work buffers

    # ------------------------------------------------------------------ the residual
    @property
    def residual(self) -> torch.Tensor | None:
        """What was not sent yet (1-D, the input's numel), or None before the first step."""
        return self._residual

    @residual.setter
    def residual(self, value: torch.Tensor | None) -> None:
        """Replace the residual from outside (a checkpoint, a regrouping); cancels a pending fold."""
        self._residual = value
        self._folded = False

    def state_dict(self) -> dict:
        return {"residual": cpu_copy(self._residual)}

    def load_state_dict(self, d: dict, device=None) -> None:
        res = d.get("residual")
        self.residual = None if res is None else res.to(device if device is not None else res.device).clone()
        self.forget_buffers()

    def forget_buffers(self) -> None:
        """Drop the recycled work buffers (the next steps allocate them again)."""
        self._spare = None
        self._padded = [None, None]

    # ------------------------------------------------------------------ one step
    def add(self, grad: torch.Tensor, padded: int | None = None) -> torch.Tensor:
        """``acc = grad + residual`` (a copy of ``grad`` on the first step), the input checked in the
        same pass. ``padded``: ``acc`` followed by zeros up to ``padded`` entries, in one of two
        alternating work buffers. After :meth:`mark_folded`, ``grad`` must be the fold target, which
        is returned after the check."""
        res = self._residual
        if self._folded:
            self._folded = False
            if grad is not res:
                raise RuntimeError("ErrorFeedback.add after mark_folded() needs the fold target itself (the "
                                   "residual, which already holds the input); got another tensor")
            self._check(res)
            return res
        if padded is not None:
            return self._add_padded(grad, res, padded)
        decay = self.decay
        if res is None:
            out = torch.empty_like(grad, memory_format=torch.contiguous_format)
            return sum_checked(out, grad, None, self.on_nonfinite)
        if (not self.in_place or res.shape != grad.shape or res.dtype != torch.result_type(grad, res)
                or res.device != grad.device or res.data_ptr() == grad.data_ptr()):
            out = torch.empty(grad.shape, dtype=torch.result_type(grad, res), device=grad.device)
            return sum_checked(out, grad, res, self.on_nonfinite, decay)
        if self.on_nonfinite is not None:  # the checked form: into the other buffer, then swap
            spare = self._spare
            if (spare is None or spare.shape != res.shape or spare.dtype != res.dtype or spare.device != res.device
                    or _shares_storage(spare, res) or _shares_storage(spare, grad)):
                spare = torch.empty_like(res, memory_format=torch.contiguous_format)
            sum_checked(spare, grad, res, self.on_nonfinite, decay)  # raises before anything is sent; res unchanged
            self._spare = res
            return spare
        return res.add_(grad) if decay == 1.0 else torch.add(grad, res, alpha=decay, out=res)

    def take(self, acc: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(vals, sent)``: ``acc`` at the unique ``idx`` and what travels (rounded to the wire
        dtype), with :meth:`keep` done for them (``acc`` keeps ``acc - sent`` there: zero for fp32).
        fp32 values on the CPU with ascending ``idx``: the gather and the zeroing in one visit of each
        entry (:func:`sparsync.native.take_clear`)."""
        idx = idx.to(torch.int64)
        if self.wire_dtype is None and native.usable(acc) and acc.dim() == 1 and idx.device.type == "cpu":
            vals = native.take_clear(acc, idx.contiguous())
            if vals is not None:
                self._residual = acc
                return vals, vals
        vals = acc.index_select(0, idx)
        sent = round_to_wire(vals, self.wire_dtype)
        self.keep(acc, idx, sent, acc_vals=vals)
        return vals, sent

    def keep(self, acc: torch.Tensor, sent_idx: torch.Tensor | None = None, sent_vals: torch.Tensor | None = None,
             acc_vals: torch.Tensor | None = None) -> None:
        """The residual becomes ``acc`` minus what was sent at ``sent_idx`` (None: ``acc`` as it is).

        ``sent_vals`` (the values actually sent) when they are rounded: the entry keeps
        ``acc - float(sent)``, exact in fp32 (a value and its fp16/bf16 rounding are within a factor
        2 unless the rounding is 0 or saturated, and then the difference is a representable fp32),
        so ``acc == residual + sent`` holds bitwise. ``acc_vals``: ``acc`` at ``sent_idx`` when the
        caller gathered it already (``sent_idx`` unique); given with ``sent_vals`` of ``acc``'s dtype
        that are another tensor (a quantised value's decode, a sketch's estimate), the entry keeps
        ``acc_vals - sent_vals``. Otherwise the sent entries are zeroed. ``O(len(sent_idx))``.
        Takes ownership of ``acc`` (modified in place)."""
        if sent_idx is not None:
            idx = sent_idx.to(torch.int64)
            if sent_vals is None or sent_vals is acc_vals or (sent_vals.dtype == acc.dtype and acc_vals is None):
                acc.index_fill_(0, idx, 0)
            else:
                old = acc.index_select(0, idx) if acc_vals is None else acc_vals
                set_at(acc, idx, old - sent_vals.to(acc.dtype))
        self._residual = acc

    def put_back(self, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """``residual[idx] += vals`` (``idx`` unique, after :meth:`take` / :meth:`keep` this step): what a
        re-selection returns to this rank - its own taken entries that the final set did not keep
        (gTop-k's end-procedure put-back), or received sums it dropped at a merge (an in-procedure
        store). ``O(len(idx))``."""
        add_at(self._residual, idx, vals)

    def hold(self, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """``residual[idx] = vals`` (``idx`` unique, after :meth:`keep` this step): what a collective
        left with this rank at ``idx`` replaces the accumulator there (SparDL's in-procedure store on
        the final index set). ``O(len(idx))``."""
        set_at(self._residual, idx, vals)

    def drain(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus a residual assigned from outside (:attr:`residual`), which is then empty: for a
        reducer whose error feedback lives elsewhere (an inner reducer's memory) and whose own memory
        only carries such a residual into the next input once. ``grad`` itself (no pass) when there
        is none; else one pass, the bits of ``grad + residual``, unchecked (the inner reducer checks
        what it accumulates)."""
        res = self._residual
        self.residual = None
        return grad if res is None else grad + res

    # ------------------------------------------------------------------ fold
    def fold_target(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor | None:
        """The buffer a caller may add the next input of ``numel`` entries into (then
        :meth:`mark_folded`): the residual, when the next :meth:`add` would add into it in place;
        else None (first step, ``in_place=False``, a ``decay`` below 1, another shape, dtype or device)."""
        res = self._residual
        if (res is None or not self.in_place or self.decay != 1.0 or res.dim() != 1 or res.numel() != numel
                or res.dtype != dtype or res.device != device):
            return None
        return res

    def mark_folded(self) -> None:
        """The caller added this step's input into :meth:`fold_target`'s buffer: the next :meth:`add`
        gets that buffer and adds nothing."""
        if self._residual is None:
            raise RuntimeError("ErrorFeedback.mark_folded: there is no residual to have folded into")
        self._folded = True

    # ------------------------------------------------------------------ internals
    def _check(self, x: torch.Tensor) -> None:
        if self.on_nonfinite is not None and not sums_finite(x):
            self.on_nonfinite(x, None)

    def _add_padded(self, grad: torch.Tensor, res: torch.Tensor | None, padded: int) -> torch.Tensor:
        n = grad.numel()
        A = self._padded_buffer(padded, grad, res)
        sum_checked(A[:n], grad, res, self.on_nonfinite, self.decay)
        A[n:].zero_()
        return A

    def _padded_buffer(self, numel: int, grad: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
        """One of two recycled buffers: one that holds neither the residual nor ``grad``."""
        bufs = self._padded

        def usable(x):
            return x is not None and x.numel() == numel and x.dtype == grad.dtype and x.device == grad.device

        for x in bufs:
            if usable(x) and not _shares_storage(x, res) and not _shares_storage(x, grad):
                return x
        slot = 1 if (usable(bufs[0]) and _shares_storage(bufs[0], res)) else 0
        bufs[slot] = torch.empty(numel, dtype=grad.dtype, device=grad.device)
        return bufs[slot]
