"""Recycled result buffers: a large tensor handed to a caller is reused once nobody holds it any more.

Why: a fresh multi-MB CPU tensor is page-faulted in on first touch, which costs several times
zeroing a recycled buffer of the same size (more when ranks share cores). Reducers
(:meth:`sparsync.reducers.base.Reducer.output_buffer`) and collectives that return dense results
(``dsar_split_allgather``) keep a small pool.

Safety: a pooled buffer is reused only when its storage has no reference outside the pool - the
caller always gets an alias (``buf.view(-1)``), so while it, or any view or ``numpy()`` alias of it,
is alive the storage's reference count is above the pool's own. A tensor the caller still holds is
never overwritten.

Reference counts: torch has no public API for a storage's use count; the private
``torch._C._storage_Use_Count`` is read in one place (:func:`_storage_use_count`). Where it fails
(an older or newer torch without it), nothing is recycled - results stay correct, every call
allocates afresh - and a ``RuntimeWarning`` naming the reason is issued once per process.

Zero fill: from :data:`STREAM_MIN_BYTES` on a CPU buffer is zeroed by streaming stores
(:func:`sparsync.native.zero_`: half the memory traffic of ``zero_``, no read of the lines
it writes); smaller ones, which the caches hold for the writes that follow, by ``zero_``.
"""

from __future__ import annotations

import warnings

import torch

from . import native

__all__ = ["STREAM_MIN_BYTES", "fill_zero", "recycled"]

#: the smallest buffer zeroed by streaming stores (well above a core's L2: a smaller buffer is
#: better left in the cache for the scatter that fills it next)
STREAM_MIN_BYTES = 8 << 20


def fill_zero(buf: torch.Tensor) -> torch.Tensor:
    """``buf.zero_()``, by streaming stores for a large contiguous CPU buffer (module docstring)."""
    if buf.device.type == "cpu" and buf.numel() * buf.element_size() >= STREAM_MIN_BYTES and buf.is_contiguous():
        if native.enabled():  # loads (or builds) the kernels on the first large fill
            return native.zero_(buf)
    return buf.zero_()


#: set once the fallback was announced (a process-wide one-shot: the warning, not the decision)
_warned = False


def _storage_use_count(t: torch.Tensor) -> int | None:
    """References to ``t``'s storage (tensors, views, aliases); None when torch cannot tell, and
    then a ``RuntimeWarning`` once per process: buffers are no longer recycled (slower, still correct)."""
    try:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    except Exception as e:  # noqa: BLE001 - private API: without it, never recycle
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(f"sparsync: result buffers are not recycled, every reduction allocates its output "
                          f"afresh (slower for large gradients, results unchanged): torch's storage use "
                          f"count is unavailable (torch._C._storage_Use_Count: {type(e).__name__}: {e})",
                          RuntimeWarning, stacklevel=3)
        return None


def recycled(pool: list, numel: int, dtype: torch.dtype, device, zero: bool = False, keep: int = 2) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements from ``pool`` (a list the owner keeps), zero-filled with
    ``zero=True`` (else uninitialised: for results that are fully overwritten).

    ``pool`` holds ``(buffer, its own storage count)`` pairs, most recently used last, at most
    ``keep`` of them (the caller typically still holds the previous result while the next one is
    made, so 2); ``keep=0`` disables recycling.
    """
    device = torch.device(device)
    for i, (buf, own) in enumerate(pool):
        if (own is not None and buf.numel() == numel and buf.dtype == dtype and buf.device == device
                and _storage_use_count(buf) == own):
            pool.append(pool.pop(i))  # most recently used last
            return (fill_zero(buf) if zero else buf).view(-1)
    buf = (torch.zeros if zero else torch.empty)(int(numel), dtype=dtype, device=device)  # fresh: page faults anyway
    own = _storage_use_count(buf)
    if own is not None:
        pool.append((buf, own))
        while len(pool) > max(0, int(keep)):
            pool.pop(0)
    return buf.view(-1)
