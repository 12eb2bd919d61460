"""Optional C kernels for what torch has no fast CPU op for: stream compaction by magnitude, buckets.

What: :func:`compact_abs_ge` returns the sorted indices ``i`` with ``|x[i]| >= t`` of a 1-D fp32
CPU tensor; :func:`compact_rows_abs_ge` the flat indices ``r * cols + c`` with ``|X[r, c]| >= t[r]``
of a ``[rows, cols]`` matrix (one threshold per row); :func:`bucket_count` the bucket of every value
among sorted edges and the histogram of the buckets; :func:`decode_block16` MiCRO's 16-bit index
messages (:mod:`sparsync.blockindex`); :func:`momentum_fold` momentum correction and error
feedback in one pass (:mod:`sparsync.convergence`); :func:`chunked_topk` SparseLoCo's per-chunk top-k and
:func:`add_packed` the sum of its messages (:mod:`sparsync.select.chunked`,
:mod:`sparsync.select.quantise`); :func:`zero_` a zero fill and :func:`sum_check`
``out = r + g`` with the finite check of ``g``, both with streaming stores (large result buffers,
the reducers' input check: :mod:`sparsync.recycle`,
:meth:`sparsync.reducers.base.Reducer.sum_checked`). They serve the threshold selection
(:func:`sparsync.select.threshold.threshold_indices`: MiCRO, hard threshold), MiCRO's calibration
histogram (:func:`sparsync.select.threshold.local_histogram`) and the candidate pass of the exact
top-k (:mod:`sparsync.select.exact`: every top-k reducer, SparDL's block selection). The result is
the same, in the same order, as the torch kernels they replace (tested side by side); only the time
differs.

Why: torch has no stream compaction on the CPU; ``nonzero`` over a mask writes and re-reads the
mask, and the threshold kernel's chunked ``abs``/``ge``/``nonzero`` and the exact top-k's candidate
pass each visit every element several times. The C loop (``kernels.c``: AVX2 compares, one 64-bit
mask per 64 elements, only the set bits visited) costs about one read of ``x``
(``sparsync bench-select`` times the selection kernels with both paths side by side).

Use: :func:`usable(x) <usable>` says whether a tensor can take the C path; callers keep their torch
path for everything else (CUDA, other dtypes, non-contiguous views) and when the kernels are off.
``SPARSYNC_NATIVE=0`` turns them off (:func:`switched_off` for a block: :class:`KernelSwitch`); when
they cannot be loaded the torch kernels run after one warning naming the reason (:func:`info` says
which path runs, why, and where the library came from). ``ctypes`` releases the GIL during the
call, so a rank's training thread runs Python meanwhile.

Build and load: ``kernels.c`` is compiled when the package is built or installed
(:mod:`~sparsync.native.build`, called by ``setup.py``); importing and using the package then compiles
nothing. A source checkout without that build compiles once per source version into a private cache.
A library is loaded only from a place no other user can write (:mod:`~sparsync.native.trust`,
:mod:`~sparsync.native.loader`) and bound through one declared table checked against the library
(:mod:`~sparsync.native.binding`).

Buffers: the output is written into a per-thread scratch buffer that grows to the largest count
seen (a second pass when a count exceeds it), then the ``count`` indices are copied out, so no
full-size allocation happens per call and results the caller keeps are never overwritten.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings

import torch

from .build import BuildError
from .loader import load

__all__ = ["KernelSwitch", "SWITCH", "add_packed", "bucket_count", "chunked_topk", "compact_abs_ge",
           "compact_rows_abs_ge", "decode_block16", "enabled", "info", "momentum_fold", "sum_check", "switched_off",
           "take_clear", "usable", "zero_"]

#: initial capacity of a thread's index buffer (int64 entries; grows on demand)
_FIRST_CAPACITY = 1 << 16

_lock = threading.Lock()
_state: dict = {}  # "lib" (ctypes.CDLL or None), "why" (str: the reason when None), "origin" (str)
_local = threading.local()


class KernelSwitch:
    """Turns the C kernels off for a block, for EVERY thread of the process (:func:`switched_off`).

    Process-wide on purpose: the blocks exist for side-by-side timings and tests, and the thread ranks
    of ``run_local(backend="thread")`` are threads started inside the block - a per-thread switch
    would miss them (and a rank process of ``backend="gloo"`` forked inside it inherits the count).
    Blocks may nest and overlap across threads: a count under a lock (``blocks``), and the kernels
    come back when the last open block ends, whatever the order the blocks end in.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.blocks = 0  # open blocks, of any thread

    @property
    def off(self) -> bool:
        return self.blocks > 0

    @contextlib.contextmanager
    def block(self):
        """Inside it the torch kernels run, in every thread."""
        with self._lock:
            self.blocks += 1
        try:
            yield
        finally:
            with self._lock:
                self.blocks -= 1


#: the switch of this process
SWITCH = KernelSwitch()


def _library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (switched off, or not loadable: warned once)."""
    if SWITCH.blocks:
        return None
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        if os.environ.get("SPARSYNC_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            _state.update(lib=None, why="switched off (SPARSYNC_NATIVE=0)", origin="")
            return None
        try:
            lib, origin = load()
            _state.update(lib=lib, why="", origin=origin)
        except BuildError as e:
            _state.update(lib=None, why=f"not loaded: {e}", origin="")
            warnings.warn(f"sparsync.native: C kernels not loaded ({e}); using the slower torch kernels",
                          RuntimeWarning, stacklevel=3)
        return _state["lib"]


def enabled() -> bool:
    """True when the C kernels are loaded and not switched off."""
    return _library() is not None


def info() -> dict:
    """Which path runs: ``{"enabled", "vectorised", "why", "origin"}`` (for reports and bug reports);
    ``origin`` says where the library came from (installed with the package, or a build cache)."""
    lib = _library()
    why = "switched off for a block (native.switched_off)" if SWITCH.blocks else _state.get("why", "")
    return {"enabled": lib is not None, "vectorised": bool(lib and lib.sparsync_vectorised()),
            "why": why, "origin": _state.get("origin", "") if lib is not None else ""}


def switched_off():
    """Inside the block the torch kernels run, for EVERY thread of the process (thread ranks
    included): side-by-side timings and tests. Blocks may nest and overlap across threads: the
    kernels come back when the last open block ends (:class:`KernelSwitch`)."""
    return SWITCH.block()


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` can take the C path: a contiguous fp32 CPU tensor, and the kernels are on."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and enabled()


def _buffer(need: int) -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _local.buf = torch.empty(max(need, _FIRST_CAPACITY), dtype=torch.int64)
    return buf


def _run(call, most: int) -> torch.Tensor:
    """``call(out_ptr, cap) -> count``; a second call with room for all when the buffer was short."""
    buf = _buffer(min(most, _FIRST_CAPACITY))
    count = call(buf.data_ptr(), buf.numel())
    if count > buf.numel():
        buf = _buffer(count)
        count = call(buf.data_ptr(), buf.numel())
    return buf[:count].clone()


def compact_abs_ge(x: torch.Tensor, t: float, base: int = 0) -> torch.Tensor:
    """Sorted int64 indices ``base + i`` with ``|x[i]| >= t`` (NaN never passes); ``x`` :func:`usable`."""
    if not usable(x) or x.dim() != 1:
        raise ValueError("compact_abs_ge needs a 1-D contiguous fp32 CPU tensor and the C kernels on "
                         f"(got {tuple(x.shape)} {x.dtype} on {x.device}; {info()['why'] or 'kernels on'})")
    lib, n, ptr = _library(), x.numel(), x.data_ptr()
    return _run(lambda out, cap: lib.sparsync_compact_abs_ge_f32(ptr, n, float(t), int(base), out, cap), n)


def compact_rows_abs_ge(X: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Sorted flat int64 indices ``r * cols + c`` with ``|X[r, c]| >= t[r]``; ``X`` 2-D :func:`usable`."""
    if not usable(X) or X.dim() != 2:
        raise ValueError("compact_rows_abs_ge needs a 2-D contiguous fp32 CPU tensor and the C kernels on "
                         f"(got {tuple(X.shape)} {X.dtype} on {X.device}; {info()['why'] or 'kernels on'})")
    rows, cols = X.shape
    tt = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if tt.numel() != rows:
        raise ValueError(f"compact_rows_abs_ge needs one threshold per row ({rows}), got {tt.numel()}")
    lib, ptr, tptr = _library(), X.data_ptr(), tt.data_ptr()
    return _run(lambda out, cap: lib.sparsync_compact_rows_abs_ge_f32(ptr, rows, cols, tptr, out, cap), X.numel())


def bucket_count(v: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hist, bucket)``: ``bucket[i] = #{j : edges[j] <= v[i]}`` (NaN: ``len(edges)``, as
    ``torch.bucketize(..., right=True)``) and ``hist`` its counts (``len(edges) + 1`` entries).
    ``v`` 1-D :func:`usable`; ``edges`` sorted ascending (fp32, CPU)."""
    if not usable(v) or v.dim() != 1:
        raise ValueError("bucket_count needs a 1-D contiguous fp32 CPU tensor and the C kernels on "
                         f"(got {tuple(v.shape)} {v.dtype} on {v.device}; {info()['why'] or 'kernels on'})")
    e = edges.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)
    if e.numel() > 1 and not bool((e[1:] >= e[:-1]).all()):
        raise ValueError("bucket_count needs edges sorted ascending")
    bucket = torch.empty(v.numel(), dtype=torch.int64)
    hist = torch.empty(e.numel() + 1, dtype=torch.int64)
    _library().sparsync_bucket_count_f32(v.data_ptr(), v.numel(), e.data_ptr(), e.numel(),
                                         bucket.data_ptr(), hist.data_ptr())
    return hist, bucket


def decode_block16(msg: torch.Tensor, start: int, nb: int, count: int) -> torch.Tensor:
    """:func:`sparsync.blockindex.decode_block16` in one C loop: the ``count`` int64 indices of an
    int16 message (``nb`` int32 block counts, then the offsets); a message whose counts do not add
    up to ``count`` is refused."""
    if not (enabled() and msg.device.type == "cpu" and msg.dtype == torch.int16 and msg.is_contiguous()):
        raise ValueError("decode_block16 needs a contiguous int16 CPU tensor and the C kernels on")
    if msg.numel() < 2 * nb + count:
        raise ValueError(f"block16 message of {msg.numel()} words is shorter than its {nb} counts and {count} indices")
    out = torch.empty(count, dtype=torch.int64)
    total = _library().sparsync_decode_block16(msg.data_ptr(), int(nb), int(start), int(count), out.data_ptr())
    if total != count:
        raise ValueError(f"block16 message: its block counts add up to {total}, expected {count} indices")
    return out


def momentum_fold(u: torch.Tensor, r: torch.Tensor, g: torch.Tensor | None, m: float, nesterov: bool) -> None:
    """In one pass: ``u = m u + g`` and ``r += u`` (``r += g + m u`` with ``nesterov``); ``g=None``: a zero
    gradient. The same bits as torch's ``torch.add(g, u, alpha=m, out=u)`` then ``r.add_(...)``
    (:meth:`sparsync.convergence.GradientPolicy.before_reduce_parts`). ``u``, ``r``, ``g`` 1-D
    :func:`usable` of one length."""
    n = u.numel()
    if not (usable(u) and usable(r) and (g is None or usable(g)) and u.dim() == r.dim() == 1
            and r.numel() == n and (g is None or g.numel() == n)):
        raise ValueError("momentum_fold needs 1-D contiguous fp32 CPU tensors of one length and the C kernels on")
    _library().sparsync_momentum_fold_f32(u.data_ptr(), r.data_ptr(), None if g is None else g.data_ptr(), n,
                                          float(m), int(bool(nesterov)))


def zero_(x: torch.Tensor) -> torch.Tensor:
    """``x.zero_()`` by streaming stores (any dtype; ``x`` a contiguous CPU tensor, kernels on).

    For buffers much larger than the caches only: a streaming store skips the read of the line it
    writes, so the fill moves half the bytes, but leaves nothing in the cache for a reader that
    follows at once (:mod:`sparsync.recycle` uses it from :data:`STREAM_MIN_BYTES` on)."""
    if not (enabled() and x.device.type == "cpu" and x.is_contiguous()):
        raise ValueError("zero_ needs a contiguous CPU tensor and the C kernels on "
                         f"(got {tuple(x.shape)} on {x.device}; {info()['why'] or 'kernels on'})")
    _library().sparsync_zero_nt(x.data_ptr(), x.numel() * x.element_size())
    return x


def sum_check(out: torch.Tensor, r: torch.Tensor | None, g: torch.Tensor) -> bool:
    """In one pass: ``out = r + g`` (``r=None``: ``out = g``), and whether every ``out`` is finite.

    The same bits as ``torch.add(g, r, out=out)`` / ``out.copy_(g)``; ``out`` is written even when
    it is not finite (so it must be a scratch buffer then: never ``r`` or ``g``). Streaming stores
    (see :func:`zero_`), and one pass instead of ``torch.add(..., out=)`` and a separate finite check
    (``g.sum()``). 1-D :func:`usable` tensors of one length."""
    n = g.numel()
    if not (usable(out) and usable(g) and (r is None or usable(r)) and out.dim() == g.dim() == 1
            and out.numel() == n and (r is None or (r.dim() == 1 and r.numel() == n))):
        raise ValueError("sum_check needs 1-D contiguous fp32 CPU tensors of one length and the C kernels on")
    if n == 0:
        return True
    span = 4 * n
    if any(abs(out.data_ptr() - x.data_ptr()) < span for x in (g, r) if x is not None):
        raise ValueError("sum_check writes a separate buffer: out must not overlap r or g")
    return bool(_library().sparsync_sum_check_f32(out.data_ptr(), None if r is None else r.data_ptr(),
                                                  g.data_ptr(), n))


def take_clear(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """``vals = x[idx]`` and then ``x[idx] = 0`` in one visit of each entry (the values a reducer
    sends and the error feedback's zeroing of them: ``index_select`` + ``index_fill_`` in torch).
    ``idx``: int64, contiguous CPU, strictly ascending in ``[0, len(x))``; otherwise None and ``x``
    untouched (the caller takes the torch path). ``x`` 1-D :func:`usable`."""
    if not (usable(x) and x.dim() == 1 and idx.dtype == torch.int64 and idx.device.type == "cpu"
            and idx.dim() == 1 and idx.is_contiguous()):
        raise ValueError("take_clear needs a 1-D contiguous fp32 CPU tensor, int64 CPU indices and the C kernels on")
    k = idx.numel()
    out = torch.empty(k, dtype=x.dtype)
    if k and _library().sparsync_take_clear_f32(x.data_ptr(), x.numel(), idx.data_ptr(), k, out.data_ptr()) != 0:
        return None
    return out


def chunked_topk(x: torch.Tensor, chunk: int, k: int, klast: int) -> torch.Tensor:
    """:func:`sparsync.select.chunked.chunked_topk` by a radix select per chunk (over the entries at or above
    a guess from the previous chunk when they are enough, else the whole chunk): the sorted int64 indices
    of the ``k`` largest ``|x|`` of every full chunk and the ``klast`` largest of a short last one (ties:
    the lower index; the same indices as the torch form). ``x`` 1-D :func:`usable`, finite."""
    if not usable(x) or x.dim() != 1:
        raise ValueError("chunked_topk needs a 1-D contiguous fp32 CPU tensor and the C kernels on")
    n = x.numel()
    full, rest = divmod(n, chunk)
    out = torch.empty(full * min(k, chunk) + (min(klast, rest) if rest else 0), dtype=torch.int64)
    got = _library().sparsync_chunked_topk_f32(x.data_ptr(), n, int(chunk), int(k), int(klast), out.data_ptr())
    if got != out.numel():
        raise ValueError(f"chunked_topk: k {k} / last {klast} do not fit chunks of {chunk} over {n} entries")
    return out


def add_packed(out: torch.Tensor, msg: torch.Tensor, count: int, chunk: int, k: int, width: int, bits: int) -> bool:
    """``out[start(p) + index_p] += table[code_p]`` for the ``count`` entries of one message of
    :func:`sparsync.select.quantise.encode_message` (``bits`` 2, 4, 8; ``width`` <= 24), ``start(p)``
    the chunk start of entry ``p`` (``k`` entries per full chunk of ``chunk``, the rest in the last):
    the same bits as the torch decode and ``index_add_``. ``out`` 1-D :func:`usable`; ``msg`` contiguous
    uint8 CPU of exactly the message's bytes. False, ``out`` untouched, when an index falls outside."""
    nbytes = -(-count * width // 8) + -(-count * bits // 8) + 4 * (1 << bits)
    if not (usable(out) and out.dim() == 1 and msg.dtype == torch.uint8 and msg.device.type == "cpu"
            and msg.is_contiguous() and msg.numel() == nbytes and bits in (2, 4, 8) and 1 <= width <= 24):
        raise ValueError("add_packed needs a 1-D fp32 output, the message's exact uint8 bytes, 2/4/8-bit "
                         "values, indices of at most 24 bits, and the C kernels on")
    return _library().sparsync_add_packed_f32(out.data_ptr(), out.numel(), msg.data_ptr(), int(count), int(chunk),
                                              int(k), int(width), int(bits)) == 0
