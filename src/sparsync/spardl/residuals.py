"""The working buffer of one SparDL step and the three residual schemes (SparDL paper §8).

One dense buffer ``X`` (length ``q*bs``, viewed as ``[q, bs]`` blocks) starts as ``A = grad + residual``
and is turned *in place* into the paper's in-procedure store ``R_w``: a block's selected positions are
zeroed when it is sent (``R[b] = X[b]`` minus the sent part, Alg. 1 line 7), received entries are added
into held blocks, R-SAG/B-SAG discards are added with their shares. Instead of keeping a second dense
copy ``Gcopy = A`` (one more pass over ``n``), every in-place modification first saves the old values at
the touched positions (sparse, O(k) per step); undoing them in reverse order restores ``A`` exactly.
:meth:`WorkBuffer.finish` does that and names what each scheme keeps; the reducer's memory
(:class:`~sparsync.reducers.memory.ErrorFeedback`) writes the residual ``xi`` from it:

* ``global`` (GRES): ``xi = R`` on the final index set ``I``, ``A`` elsewhere — read ``R`` on ``I``,
  restore every touched position, the memory holds ``R`` on ``I`` (two O(k) index passes instead of a
  membership test of every touched position in ``I``). Conserving:
  ``sum_w (G_w + xi_old) == g_sum + sum_w xi_new``.
* ``partial`` (PRES, local + end-procedure): ``xi = A`` everywhere except own-selected positions in ``I``
  (those are zero). In-procedure residuals (others' values discarded here at surviving indices) are lost.
* ``local`` (LRES, DGC-style): ``xi = A`` with every position this worker selected zeroed; in-procedure
  and end-procedure residuals are lost.
"""

from __future__ import annotations

import torch

from ..sparse import IndexFlags, add_at, set_at

__all__ = ["RESIDUAL_MODES", "WorkBuffer"]

RESIDUAL_MODES = ("global", "partial", "local")


class WorkBuffer:
    def __init__(self, A: torch.Tensor, q: int, bs: int):
        self.flat = A  # padded to q*bs, owned
        self.blocks = A.view(q, bs)
        self.bs = bs
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._own: list[torch.Tensor] = []

    def zero_selected(self, rows: torch.Tensor, first_block: int, sel: torch.Tensor, own: bool = True,
                      vals: torch.Tensor | None = None):
        """Zero ``sel`` (``[m, c]`` column indices) in rows ``first_block..`` (a view of ``blocks``).

        ``vals``: ``rows.gather(1, sel)`` when the caller has it already (saves a gather)."""
        pos = (sel + (torch.arange(rows.shape[0], device=sel.device) + first_block)[:, None] * self.bs).view(-1)
        self._saved.append((pos, self.flat.index_select(0, pos) if vals is None else vals.reshape(-1)))
        rows.scatter_(1, sel, 0)
        if own:
            self._own.append(pos)

    def add(self, pos: torch.Tensor, vals: torch.Tensor):
        """``X[pos] += vals`` (``pos`` unique)."""
        if pos.numel() == 0:
            return
        self._saved.append((pos, self.flat.index_select(0, pos)))
        add_at(self.flat, pos, vals.to(self.flat.dtype))

    def finish(self, mode: str, final_pos: torch.Tensor, n: int,
               members: IndexFlags | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Undo this step's changes, so that the buffer holds ``A`` again, and say what ``mode`` keeps,
        ``(idx, vals)``: ``vals`` None (``partial``, ``local``): ``idx`` are the own positions that were
        sent (the memory clears them: ``memory.keep(A[:n], idx)``); else (``global``) ``R`` on ``I``,
        what the procedure left here (``memory.keep(A[:n])``, then ``memory.hold(idx, vals)``).
        ``final_pos`` = flat positions of ``I``; positions in the padding past ``n`` are left out.
        ``O(k)``: the saved positions only.

        ``members``: an :class:`~sparsync.sparse.IndexFlags` the caller keeps across steps, for
        ``partial``'s O(k) membership test in ``I`` (a fresh one - one zero fill of the buffer's
        length - otherwise; ``global`` and ``local`` need none).
        """
        X = self.flat
        # every position list here is unique (selected or received positions, I): gathers and
        # scatters by index_select / set_at (a fraction of the cost of X[pos] on CPU)
        kept = X.index_select(0, final_pos) if mode == "global" else None  # R on I, before the restore
        for pos, old in reversed(self._saved):
            set_at(X, pos, old)
        if mode == "global":  # A everywhere, R on I: no membership test needed
            pos = final_pos
        else:
            members = members or IndexFlags()
            pos = torch.cat(self._own) if self._own else final_pos[:0]
            if mode == "partial":
                pos = pos[members.isin(pos, final_pos, X.numel())]
        if X.numel() > n:  # the padding is no one's residual
            inside = pos < n
            pos, kept = pos[inside], (None if kept is None else kept[inside])
        return pos, kept
