"""Per-group flat gradient buffers; ``param.grad`` lives as a view into them (DDP's ``gradient_as_bucket_view``).

Each dense communication group owns one persistent 1-D buffer, allocated once per plan. After a
step every parameter's ``.grad`` is a view of its slice, so:

* **gather** (the group's gradients -> the flat tensor handed to the reducer) copies nothing for a
  parameter whose ``.grad`` is still that view (``zero_grad(set_to_none=False)``, ``no_sync``
  accumulation: autograd accumulated in place), and otherwise copies once into the slice (a
  ``.grad`` that autograd allocated after ``zero_grad(set_to_none=True)``, like DDP does) - never
  a ``torch.cat`` and never a fresh allocation;
* **write back** (reducer output -> ``.grad``) is one pass that also divides by P:
  ``torch.div(out, P, out=flat)``; when the output *is* the buffer it is ``flat.div_(P)``.

Passes per dense step over a group of n entries (excluding the reducer): at most 1 copy in, 1 read
(the non-finite check, :func:`~sparsync.schedule.guards.all_finite`), 1 divide-and-write out.
"""

from __future__ import annotations

import torch

__all__ = ["GradBuffers"]


class GradBuffers:
    def __init__(self, params, as_view: bool = True):
        self.params = list(params)
        self.as_view = as_view  # False: fresh gradient tensors each step (DDP's gradient_as_bucket_view=False)
        self.groups: list[list[int]] = []
        self.flat: list[torch.Tensor | None] = []
        self.views: list[list[torch.Tensor] | None] = []

    def set_groups(self, groups) -> None:
        """New plan: buffers are (re)allocated lazily, on each group's first gather."""
        self.groups = [list(g) for g in groups]
        self.flat = [None] * len(self.groups)
        self.views = [None] * len(self.groups)

    def _buffer(self, g: int) -> torch.Tensor:
        flat = self.flat[g]
        if flat is None:
            ps = [self.params[i] for i in self.groups[g]]
            flat = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            views, off = [], 0
            for p in ps:
                views.append(flat[off:off + p.numel()].view(p.shape))
                off += p.numel()
            self.flat[g], self.views[g] = flat, views
        return flat

    def gather(self, g: int, grads) -> tuple[torch.Tensor, int]:
        """The group's local gradient as its flat buffer; returns (buffer, bytes copied)."""
        flat = self._buffer(g)
        copied = 0
        for gr, view in zip(grads, self.views[g]):
            if gr is None:
                view.zero_()
            elif _is_view_of(gr, view):
                continue
            else:
                view.copy_(gr.to_dense() if gr.is_sparse else gr)
                copied += view.numel() * view.element_size()
        return flat, copied

    def write_average(self, g: int, out: torch.Tensor, P: int) -> None:
        """``.grad`` of every parameter of group ``g`` := its slice of ``out / P`` (one pass)."""
        out = out.reshape(-1)
        if not self.as_view:
            avg = torch.div(out, P) if P > 1 else out.clone()
            for i, piece in zip(self.groups[g], torch.split(avg, [self.params[i].numel() for i in self.groups[g]])):
                self.params[i].grad = piece.view_as(self.params[i])
            return
        flat = self._buffer(g)
        if out.data_ptr() == flat.data_ptr():
            if P > 1:
                flat.div_(P)
        elif P > 1:
            torch.div(out, P, out=flat)
        else:
            flat.copy_(out)
        for i, view in zip(self.groups[g], self.views[g]):
            p = self.params[i]
            if not _is_view_of(p.grad, view):
                p.grad = view


def _is_view_of(t, view) -> bool:
    return (t is not None and not t.is_sparse and t.data_ptr() == view.data_ptr() and t.shape == view.shape
            and t.stride() == view.stride() and t.dtype == view.dtype)
