"""Per-group flat gradient buffers; ``param.grad`` lives as a view into them (DDP's ``gradient_as_bucket_view``).

Each dense communication group owns one persistent 1-D buffer, allocated once per plan. After a
step every parameter's ``.grad`` is a view of its slice, so:

* **gather** (the group's gradients -> the flat tensor handed to the reducer) copies nothing for a
  parameter whose ``.grad`` is still that view (``zero_grad(set_to_none=False)``, ``no_sync``
  accumulation: autograd accumulated in place), and otherwise copies once into the slice (a
  ``.grad`` that autograd allocated after ``zero_grad(set_to_none=True)``, like DDP does) - never
  a ``torch.cat`` and never a fresh allocation;
* **write back** (reducer output -> ``.grad``) is one pass that also divides by P:
  ``torch.div(out, P, out=flat)``; when the output *is* the buffer it is ``flat.div_(P)``, and when
  it is the input-only buffer below (a donated input reduced in place), the two buffers swap roles
  and it is ``div_`` too.

Passes per dense step over a group of n entries (excluding the reducer): at most 1 copy in, 1 read
(the non-finite check, :func:`~sparsync.schedule.guards.all_finite`), 1 divide-and-write out.

**Sparse results** (:class:`~sparsync.reducers.base.IndexedSum`, e.g. ``micro``): the buffer holds
last step's ``sum / P``, non-zero only at last step's indices. If nothing has written into the
buffer since (its version counter - shared by every ``.grad`` view - is unchanged: no in-place
``.grad`` edit by the user, no accumulation by autograd into the views), only those entries are
cleared and the new ones written: ``O(k)`` instead of a pass over ``n``; otherwise one ``zero_()``
first. To keep the buffer clean, gradients that autograd allocated afresh (``zero_grad()``'s
default ``set_to_none=True``) are gathered into a second, input-only buffer
(``gather(..., keep_output=True)``), or not copied at all when a convergence policy reads them
directly (:meth:`~sparsync.convergence.GradientPolicy.before_reduce_parts`).
"""

from __future__ import annotations

import torch

from ..sparse import set_at

__all__ = ["GradBuffers"]


class GradBuffers:
    def __init__(self, params, as_view: bool = True):
        self.params = list(params)
        self.as_view = as_view  # False: fresh gradient tensors each step (DDP's gradient_as_bucket_view=False)
        self.groups: list[list[int]] = []
        self.flat: list[torch.Tensor | None] = []
        self.views: list[list[torch.Tensor] | None] = []
        self.inputs: list[tuple | None] = []  # (input-only buffer, its views) for gather(keep_output)
        self.sparse_state: list[tuple[int, torch.Tensor] | None] = []  # (flat._version, non-zero indices)

    def set_groups(self, groups) -> None:
        """New plan: buffers are (re)allocated lazily, on each group's first gather."""
        self.groups = [list(g) for g in groups]
        self.flat = [None] * len(self.groups)
        self.views = [None] * len(self.groups)
        self.inputs = [None] * len(self.groups)
        self.sparse_state = [None] * len(self.groups)

    def _buffer(self, g: int) -> torch.Tensor:
        flat = self.flat[g]
        if flat is None:
            ps = [self.params[i] for i in self.groups[g]]
            flat = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            self.flat[g], self.views[g] = flat, _views_of(flat, ps)
        return flat

    def gather(self, g: int, grads, keep_output: bool = False, always_copy: bool = False) -> tuple[torch.Tensor, int]:
        """The group's local gradient as one flat tensor; returns (tensor, bytes copied).

        The ``.grad`` views themselves when every gradient still is one (nothing copied); else a
        copy into the ``.grad`` buffer, or - ``keep_output=True``, for a sparse result - into the
        group's input-only buffer, so the ``.grad`` buffer keeps its known non-zeros.
        ``always_copy=True`` (with ``keep_output``): the input-only buffer even when the gradients
        are the views (one copy), for a caller that writes ``.grad`` while the input is in use."""
        flat = self._buffer(g)
        views = self.views[g]
        if all(_is_view_of(gr, view) for gr, view in zip(grads, views)):
            if not always_copy:
                return flat, 0
            buf = self._input_buffer(g)[0]
            buf.copy_(flat)
            return buf, buf.numel() * buf.element_size()
        if keep_output:
            flat, views = self._input_buffer(g)
        copied = 0
        for gr, view in zip(grads, views):
            if gr is None:
                view.zero_()
            elif _is_view_of(gr, view):
                continue
            else:
                view.copy_(gr.to_dense() if gr.is_sparse else gr)
                copied += view.numel() * view.element_size()
        return flat, copied

    def owns(self, g: int, x: torch.Tensor) -> bool:
        """Whether ``x`` is group ``g``'s ``.grad`` buffer or its input-only buffer - the engine's own,
        which the write-back overwrites, so a reducer may reduce it in place (not a policy's state)."""
        bufs = [self.flat[g]] + ([self.inputs[g][0]] if self.inputs[g] is not None else [])
        return any(b is not None and x.data_ptr() == b.data_ptr() and x.numel() == b.numel() for b in bufs)

    def _input_buffer(self, g: int) -> tuple:
        """(the group's input-only buffer, its per-parameter views), allocated on first use."""
        if self.inputs[g] is None:
            buf = torch.empty_like(self._buffer(g))
            self.inputs[g] = (buf, _views_of(buf, [self.params[i] for i in self.groups[g]]))
        return self.inputs[g]

    def write_indexed(self, g: int, out, P: int) -> None:
        """``.grad`` of group ``g`` := ``out / P`` for an :class:`~sparsync.reducers.base.IndexedSum`:
        clears last step's non-zeros (or the whole buffer when it was written since) and writes the
        new ones - ``torch.div(values, P)``, the same bits as the dense path's ``torch.div(out, P)``."""
        if not self.as_view:
            dense = torch.zeros(out.numel, dtype=out.values.dtype, device=out.values.device)
            return self.write_average(g, set_at(dense, out.indices, out.values), P)
        flat = self._buffer(g)
        prev = self.sparse_state[g]
        if prev is not None and prev[0] == flat._version:
            flat.index_fill_(0, prev[1], 0)
        else:
            flat.zero_()
        vals = torch.div(out.values, P) if P > 1 else out.values
        set_at(flat, out.indices, vals.to(flat.dtype))
        self.sparse_state[g] = (flat._version, out.indices)
        self._attach(g)

    def write_average(self, g: int, out: torch.Tensor, P: int) -> None:
        """``.grad`` of every parameter of group ``g`` := its slice of ``out / P`` (one pass)."""
        out = out.reshape(-1)
        if not self.as_view:
            avg = torch.div(out, P) if P > 1 else out.clone()
            for i, piece in zip(self.groups[g], torch.split(avg, [self.params[i].numel() for i in self.groups[g]])):
                self.params[i].grad = piece.view_as(self.params[i])
            return
        flat = self._buffer(g)
        self.sparse_state[g] = None
        inp = self.inputs[g]
        if inp is not None and out.data_ptr() == inp[0].data_ptr() and out.numel() == inp[0].numel():
            # the sum is in the input-only buffer (a donated input, reduced in place): it becomes the
            # ``.grad`` buffer and the old one the input-only buffer - a swap, not a copy
            self.inputs[g] = (flat, self.views[g])
            self.flat[g], self.views[g] = inp
            flat = inp[0]
        if out.data_ptr() == flat.data_ptr():
            if P > 1:
                flat.div_(P)
        elif P > 1:
            torch.div(out, P, out=flat)
        else:
            flat.copy_(out)
        self._attach(g)

    def _attach(self, g: int) -> None:
        """Point every parameter's ``.grad`` of group ``g`` at its view (after a write)."""
        for i, view in zip(self.groups[g], self.views[g]):
            p = self.params[i]
            if not _is_view_of(p.grad, view):
                p.grad = view


def _is_view_of(t, view) -> bool:
    return (t is not None and not t.is_sparse and t.data_ptr() == view.data_ptr() and t.shape == view.shape
            and t.stride() == view.stride() and t.dtype == view.dtype)


def _views_of(flat: torch.Tensor, params) -> list[torch.Tensor]:
    """Consecutive slices of ``flat`` shaped like ``params``."""
    views, off = [], 0
    for p in params:
        views.append(flat[off:off + p.numel()].view(p.shape))
        off += p.numel()
    return views
