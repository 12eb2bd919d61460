"""Exact top-k by magnitude at the cost of about one memory pass (1-D and per row of a 2-D view).

What: :func:`topk_indices` returns the ``k`` indices of largest ``|x|``; :func:`topk_rows` does the
same for every row of a ``[m, bs]`` matrix at once (SparDL's per-block selection: no Python loop
over rows). The **set** equals ``torch.topk``'s on inputs without ties at the ``k``-th magnitude.

**Tie rule** (documented, deterministic, identical on every rank and every device): entries are
ranked by ``|x|`` descending and, among equal magnitudes, by index ascending - *the lowest indices
win*. ``NaN`` ranks below every number (below ``0``): it is chosen only when a row has fewer than
``k`` non-NaN entries, and then in index order. ``+-inf`` rank above every finite value.

Why: on a CPU ``torch.topk`` over ``n = 1e7`` entries costs about as much as a dense all-reduce of
``n`` floats at 1 Gbit/s; every method built on exact top-k pays it.

How (a sample select, then one compaction pass, then an exact select among few candidates)::

    1. sample  s <= 65536 entries of every row (strided view), their kk-th largest magnitude t,
               kk = f s + 4 sqrt(f s) + 8  (f = k / bs: four standard deviations of the sample
               count below the true k-th magnitude, so  #{|x| >= t} >= k  except for adversarial
               periodic inputs);
    2. compact every index with |x| >= t: in C (:mod:`sparsync.native`: one read of x, ~0.3 ns per
               element) for contiguous fp32 on the CPU, else in cache-sized tiles of a reusable
               workspace (|x| and the comparison stay in cache, the flags are scanned two per
               64-bit word);  about 1.2 k candidates at 1 % density;
    3. select  the k-th largest candidate magnitude v per row (a small topk over the candidates only),
               keep |x| > v and the lowest-index entries with |x| == v up to k.

The only full-size work is step 2 (one read of ``x``; no ``|x|`` copy, no mask of ``n`` bytes).
Rows whose sample was unlucky (fewer than ``k`` candidates; also all-zero or mostly-NaN rows) are
finished by the exact path - the k-th magnitude of the whole row, then step 3 - so the result is
exact whatever the data; only the speed depends on the sample. Small rows (``bs < 32768``) and
high densities (``k > bs / 8``) take that exact path directly. On an accelerator (CUDA) small
matrices take ``torch.topk`` instead, with a check that enforces the tie rule
(:func:`torch_topk_rows`; ``DEVICE_TOPK_BELOW``). ``sparsync bench-select --parts exact`` times it
against ``torch.topk``, with the C pass and with the torch pass.
"""

from __future__ import annotations

import math
import operator

import torch

from .. import native

#: elements per tile of the compaction pass (1 MiB of fp32: several ranks' workspaces fit the
#: shared last-level cache together)
CHUNK = 1 << 18

__all__ = ["DEVICE_TOPK_BELOW", "sampled_rows", "scratch_buffer", "topk_indices", "topk_rows", "topk_select",
           "torch_topk_rows"]

#: Cap on step 1's sample (the balance ``4 (k bs)^(1/3)`` in ``_sample_threshold`` reaches it only for
#: ``k bs > 4.4e12``, e.g. ``bs = 2e7`` at 1 %): each strided sample element is a cache miss (64 K of
#: them touch 4 MiB of cache lines, a few % of one pass over such a row), while the bracket's extra
#: candidates at the cap, ``~4 k / sqrt(f s)``, are already only ~16 % of ``k`` at ``f`` = 1 %.
_SAMPLE = 65536
#: Floor of step 1's sample. Below a few thousand samples ``f s`` is so small that the bracket's
#: slack (``4 sqrt(f s) + 8``) sets the threshold and the candidates are several times ``k``; 4096 is
#: 1/8 of the shortest row that samples (``_MIN_ROW``), so the sample stays a small part of the pass.
#: A round value, not tuned by a measurement of its own.
_MIN_SAMPLE = 4096
#: Weight of the sample-size balance ``s = _BALANCE (k bs)^(1/3)``: minimising ``a s + b E`` with
#: ``E = 4 sqrt(k bs / s)`` extra candidates gives ``s = (2 b / a)^(2/3) (k bs)^(1/3)``; 4 assumes a
#: surplus candidate costs ~4x a sampled cache miss (a rough estimate, not fitted).
_BALANCE = 4.0
#: Step 1's bracket ``kk = f s + _SIGMAS sqrt(f s) + _SLACK``: four standard deviations of the
#: binomial sample count, plus a constant so that tiny ``f s`` (a handful of expected hits) still
#: brackets the k-th magnitude from below.
_SIGMAS, _SLACK = 4.0, 8
#: Stands in for NaN magnitudes (and padding): every real magnitude is ``>= 0`` so ``-1`` ranks below all.
_BELOW_ALL = -1.0
#: Rows shorter than this take the exact path directly: the sample floor would be over 1/8 of the row,
#: so the sampled path saves little (a judgement: no measurement of this cut-off is recorded).
_MIN_ROW = 1 << 15
_WORD = 8  # bytes of the int64 word the flags are scanned in (``nonzero`` over words, then inside)
_MAX_FRACTION = 8  # k > bs / 8: the exact path directly (candidates would be most of the row)
_SHRINK = (torch.float32, torch.float64)  # dtypes of the fused hardshrink tile (8 // itemsize per word)
#: On an accelerator, matrices of fewer elements than this take :func:`torch_topk_rows` (torch's
#: radix select, then the tie check): there every operation's launch costs about as much as its
#: work, and the sampled path has about three times as many operations as torch's select, while
#: above it torch's select makes several passes over memory and the sampled path one. The two
#: crossed between 1e7 and 3e7 elements on an H200 (``docs/benchmarks.md``, "On a GPU"); rows too
#: short to sample, or ``k > bs / 8``, take torch's select at any size there.
DEVICE_TOPK_BELOW = 1 << 24


def _check_k(k, bs: int) -> int:
    if isinstance(k, float) and k.is_integer():
        k = int(k)
    try:
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"k must be an integer, got {k!r}") from None
    if not 0 <= k <= bs:
        raise ValueError(f"k must be in [0, {bs}], got {k}")
    return k


def scratch_buffer(scratch: dict | None, key: str, numel: int, dtype, device) -> torch.Tensor:
    """A reusable 1-D buffer of at least ``numel`` elements from ``scratch`` (a dict the caller keeps).

    Fresh multi-MB tensors are page-faulted in on first touch, several times the cost of writing
    into a reused buffer; without ``scratch`` a fresh one.
    """
    if scratch is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = scratch.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
        buf = scratch[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def topk_indices(x: torch.Tensor, k: int, scratch: dict | None = None) -> torch.Tensor:
    """Sorted int64 indices of the ``k`` largest ``|x|`` of the 1-D ``x`` (ties -> lowest index)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        raise ValueError(f"topk_indices needs a 1-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    return topk_rows(x.view(1, -1), k, scratch).view(-1)


def topk_select(x: torch.Tensor, k: int, scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, x[indices])`` of :func:`topk_indices`."""
    idx = topk_indices(x, k, scratch)
    return idx, x.index_select(0, idx)


def topk_rows(X: torch.Tensor, k: int, scratch: dict | None = None) -> torch.Tensor:
    """Column indices ``[m, k]`` (int64, ascending in every row) of the ``k`` largest ``|X[i]|``.

    ``scratch``: optional dict kept by the caller; the tile workspace is reused from it.
    """
    if not isinstance(X, torch.Tensor) or X.dim() != 2:
        raise ValueError(f"topk_rows needs a 2-D tensor, got {getattr(X, 'shape', type(X).__name__)}")
    if not X.dtype.is_floating_point:
        raise TypeError(f"topk_rows needs a floating-point tensor, got {X.dtype}")
    m, bs = X.shape
    k = _check_k(k, bs)
    dev = X.device
    if k == 0 or m == 0:
        return torch.empty(m, k, dtype=torch.int64, device=dev)
    if k == bs:
        return torch.arange(bs, device=dev).expand(m, bs).clone()
    X = X.contiguous()
    if _takes_torch_topk(X, k):
        return torch_topk_rows(X, k)
    if bs < _MIN_ROW or k * _MAX_FRACTION > bs:
        return _exact_rows(X, k)
    return sampled_rows(X, k, scratch)


def sampled_rows(X: torch.Tensor, k: int, scratch: dict | None = None) -> torch.Tensor:
    """:func:`topk_rows` by steps 1-3 (sample, compaction, select among the candidates) for a
    contiguous ``[m, bs]`` floating-point ``X`` and ``1 <= k < bs``."""
    m, bs = X.shape
    dev = X.device
    t = _sample_threshold(X, k)
    flat, cand_abs = _candidates(X, t, scratch)
    if m == 1:
        return _finish1(flat, cand_abs, k).view(1, k) if flat.numel() >= k else _exact_rows(X, k)
    rows = torch.div(flat, bs, rounding_mode="floor")
    counts = torch.bincount(rows, minlength=m)
    ok = counts >= k
    if bool(ok.all()):
        return _finish(flat, cand_abs, rows, counts, m, k).view(m, k) - torch.arange(m, device=dev)[:, None] * bs
    out = torch.empty(m, k, dtype=torch.int64, device=dev)
    bad = (~ok).nonzero().flatten()
    out[bad] = _exact_rows(X[bad], k)
    good = ok.nonzero().flatten()
    if good.numel():
        sel = ok[rows]
        grows = rows[sel]
        remap = torch.cumsum(ok.long(), 0) - 1  # row -> its position among the good rows
        sub = _finish(flat[sel], cand_abs[sel], remap[grows], counts[good], good.numel(), k)
        out[good] = sub.view(-1, k) - good[:, None] * bs
    return out


def _takes_torch_topk(X: torch.Tensor, k: int) -> bool:
    """Whether :func:`topk_rows` runs :func:`torch_topk_rows` (accelerators only; see ``DEVICE_TOPK_BELOW``)."""
    if X.device.type == "cpu":
        return False
    bs = X.shape[1]
    return X.numel() < DEVICE_TOPK_BELOW or bs < _MIN_ROW or k * _MAX_FRACTION > bs


def torch_topk_rows(X: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_rows` through ``torch.topk`` for a contiguous ``[m, bs]`` floating-point ``X`` and
    ``1 <= k < bs``, with the documented tie rule.

    ``torch.topk`` returns the ``k`` largest magnitudes, but among equal ones it picks any index (on
    CUDA, not the lowest), and it ranks NaN above every number. Its ``k``-th value ``v`` (the
    smallest it returned) decides: where exactly ``k`` entries of the row have ``|x| >= v``, no entry
    outside ties with ``v`` and no NaN was taken (``|x| >= NaN`` is false), so its indices, sorted,
    are the answer. A single row with more (ties at ``v``: likely in fp32 once ``bs`` is ~1e7, the
    values near the cut being that dense) takes every index with ``|x| >= v`` (one compare and
    compaction) and step 3 among them (:func:`_finish1`); rows of a matrix with ties, and rows with
    NaN, take the exact path (:func:`_exact_rows`).

    Few operations, each launched before the one host synchronisation (the count): on a GPU at
    these sizes every operation's launch costs about as much as its work.
    """
    m, bs = X.shape
    a = X.abs()
    vals, idx = torch.topk(a, k, dim=1, sorted=False)
    out = idx.sort(dim=1).values  # queued before the check: the GPU sorts while the host waits below
    v = vals.amin(dim=1, keepdim=True)  # the k-th magnitude (NaN if torch.topk took a NaN)
    count = (a >= v).sum(1)
    if m == 1:
        c = int(count)
        if c == k:
            return out
        if c > k:  # ties at v: every entry >= v, then the lowest indices among those equal to v
            flat = torch.nonzero(a[0] >= v[0]).squeeze(1)
            return _finish1(flat, a[0].index_select(0, flat), k).view(1, k)
        return _exact_rows(X, k)  # NaN taken: fewer than k entries >= NaN
    bad = count != k
    if not bool(bad.any()):
        return out
    rows = bad.nonzero().flatten()
    out[rows] = _exact_rows(X[rows], k)
    return out


# ---------------------------------------------------------------------- steps
def _sample_threshold(X: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, a magnitude ``t`` with (w.h.p.) at least ``k`` entries ``|x| >= t`` (step 1).

    ``t`` is always ``> 0`` (``|x| >= t`` then never admits zeros or NaN: an all-zero row gets too
    few candidates and takes the exact path).
    """
    m, bs = X.shape
    # sample size: reading it costs ~s cache misses, a loose bracket costs ~4 k / sqrt(f s) extra
    # candidates in step 3; balanced at s ~ (k bs)^(1/3), within [_MIN_SAMPLE, _SAMPLE]
    want = min(_SAMPLE, max(_MIN_SAMPLE, int(_BALANCE * (k * bs) ** (1.0 / 3.0))))
    stride = max(1, bs // want)
    sample = X[:, ::stride].abs().nan_to_num_(nan=_BELOW_ALL)
    s = sample.shape[1]
    f = k / bs
    kk = min(s, math.ceil(f * s + _SIGMAS * math.sqrt(f * s) + _SLACK))
    t = _kth_largest(sample, kk)
    tiny = torch.nextafter(torch.zeros((), dtype=X.dtype), torch.ones((), dtype=X.dtype))
    return torch.maximum(t, tiny.to(X.device))


def _tiles(m: int, bs: int, chunk: int):
    """``(flat_start, rows, r0, c0, c1)`` tiles of about ``chunk`` elements covering ``[m, bs]``.

    Whole rows are grouped when a row is shorter than a chunk, long rows are cut into column
    ranges: the number of tiles is about ``m * bs / chunk`` whatever the block size (a loop over
    cache-sized pieces of memory, not over blocks).
    """
    if bs >= chunk:
        per = -(-bs // chunk)
        step = -(-bs // per)
        for r in range(m):
            for c0 in range(0, bs, step):
                c1 = min(bs, c0 + step)
                yield r * bs + c0, 1, r, c0, c1
    else:
        rows = max(1, chunk // bs)
        for r0 in range(0, m, rows):
            r1 = min(m, r0 + rows)
            yield r0 * bs, r1 - r0, r0, 0, bs


def _candidates(X: torch.Tensor, t: torch.Tensor, scratch: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices with ``|X[r, c]| >= t[r]`` and their magnitudes (step 2; one read of ``X``).

    Contiguous fp32 on the CPU: one C pass (:func:`sparsync.native.compact_rows_abs_ge`), then the
    magnitudes of the few candidates. Otherwise per tile, into cache-resident workspaces, then
    ``nonzero`` over the flags viewed as int64 words (several flags per word: a fraction of the
    work) and a second ``nonzero`` inside the few words that hold one:

    * one row, fp32/fp64: ``hardshrink(x, t')`` with ``t'`` the float just below ``t`` (one fused
      pass: ``x`` where ``|x| > t'``, i.e. ``|x| >= t``, else ``+0``); a word is two fp32 flags;
    * otherwise (several rows per tile with their own ``t``, other dtypes): ``|x|`` then ``>= t``
      into bytes; a word is eight flags.

    NaN passes ``hardshrink``; such candidates are dropped here (NaN ranks below every number).
    """
    m, bs = X.shape
    if native.usable(X):  # the C compaction (NaN never passes): same indices, several times faster
        flat = native.compact_rows_abs_ge(X, t)
        return flat, X.view(-1).index_select(0, flat).abs_()
    if X.device.type != "cpu":
        flat = torch.nonzero((X.abs() >= t[:, None]).view(-1)).squeeze(1)
        return flat, X.view(-1)[flat].abs()
    size = min(CHUNK, m * bs)
    wf = scratch_buffer(scratch, "exact_topk_abs", size + 1, X.dtype, X.device)
    wb = scratch_buffer(scratch, "exact_topk_flags", size + _WORD, torch.bool, X.device)  # offset 0: aligned
    tt = t.to(X.dtype)
    below = torch.nextafter(tt, torch.zeros_like(tt)).tolist() if X.dtype in _SHRINK else None
    tt = tt[:, None]
    if below is not None and (m == 1 or 2 * bs > CHUNK):  # every tile is one row: hardshrink tiles
        return _candidates_shrink(X, below, wf)
    outs, mags = [], []
    for start, rows, r0, c0, c1 in _tiles(m, bs, CHUNK):
        cols = c1 - c0
        L = rows * cols
        if rows == 1 and below is not None:
            per = _WORD // X.element_size()  # elements per 64-bit word
            torch.ops.aten.hardshrink.out(X[r0, c0:c1], below[r0], out=wf[:L])
            flags, Le = wf, -(-L // per) * per
            wf[L:Le] = 0.0
        else:
            per = _WORD
            w = wf[:L].view(rows, cols)
            torch.abs(X[r0:r0 + rows, c0:c1], out=w)
            torch.ge(w, tt[r0:r0 + rows], out=wb[:L].view(rows, cols))
            flags, Le = wb, -(-L // _WORD) * _WORD
            wb[L:Le] = False
        words = torch.nonzero(flags[:Le].view(torch.int64)).squeeze(1)
        if words.numel() == 0:
            continue
        # index_select, not [] indexing: a third of the time on CPU (no TensorIterator set-up)
        ij = torch.nonzero(flags[:Le].view(-1, per).index_select(0, words)) if per > 1 else None
        local = words if ij is None else words.index_select(0, ij[:, 0]).mul_(per).add_(ij[:, 1])
        mags.append(wf.index_select(0, local).abs_())  # still in cache
        outs.append(local.add_(start))
    if not outs:
        return torch.empty(0, dtype=torch.int64, device=X.device), X.new_empty(0)
    flat, vals = (outs[0], mags[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(mags))
    num = vals == vals
    if not bool(num.all()):
        flat, vals = flat[num], vals[num]
    return flat, vals


def _candidates_shrink(X: torch.Tensor, below: list, wf: torch.Tensor):
    """:func:`_candidates` when every tile is (part of) one row and ``X`` is fp32/fp64.

    Per tile only two fused ops stay in the loop - ``hardshrink`` into the cache-resident
    workspace and ``nonzero`` over it viewed as 64-bit words - plus a gather of the few non-zero
    words (their bits hold the candidates' values). Splitting the words into elements, the
    magnitudes and the NaN filter run once over all tiles' words after the loop (a per-tile
    second ``nonzero`` and four gathers would cost more than the pass itself at 1 % density).
    """
    m, bs = X.shape
    per = _WORD // X.element_size()  # elements per 64-bit word
    wvals, wpos = [], []
    for start, _rows, r0, c0, c1 in _tiles(m, bs, CHUNK):
        L = c1 - c0
        Le = -(-L // per) * per
        torch.ops.aten.hardshrink.out(X[r0, c0:c1], below[r0], out=wf[:L])
        if Le > L:
            wf[L:Le] = 0.0
        words = wf[:Le].view(torch.int64)
        nz = torch.nonzero(words).squeeze(1)
        if nz.numel():
            wvals.append(words[nz])
            wpos.append(nz.mul_(per).add_(start))
    if not wpos:
        return torch.empty(0, dtype=torch.int64, device=X.device), X.new_empty(0)
    fl = torch.cat(wvals).view(X.dtype)  # the words' elements, word by word (ascending positions)
    sel = torch.nonzero(fl).squeeze(1)  # NaN passes hardshrink and is dropped below
    flat = torch.cat(wpos)[torch.div(sel, per, rounding_mode="floor")].add_(sel.remainder(per))
    vals = fl[sel].abs_()
    num = vals == vals
    if not bool(num.all()):
        flat, vals = flat[num], vals[num]
    return flat, vals


def _finish1(flat, vals, k: int) -> torch.Tensor:
    """:func:`_finish` for a single row (fewer passes over the candidates)."""
    v = _kth_largest(vals, k)
    keep = vals > v
    need = k - int(keep.sum())
    if need:
        keep[torch.nonzero(vals == v).squeeze(1)[:need]] = True  # lowest indices first
    return flat.index_select(0, keep.nonzero().squeeze(1))  # (a mask index costs ~1.3x here)


def _finish(flat, vals, rows, counts, m: int, k: int) -> torch.Tensor:
    """Exact top-``k`` of every row among its candidates (step 3); flat indices, row-major, ``m*k``.

    ``flat``: ascending candidate indices (so grouped by row, index order inside a row), ``vals``
    their magnitudes (NaN-free), ``rows`` their row ids in ``[0, m)``, ``counts`` per row (``>= k``).
    """
    # per-candidate lookups by index_select, the padded matrix filled by one scatter: advanced
    # indexing (offs[rows], cand[rows, pos] = ..., flat[mask]) is slower here
    dev = flat.device
    cmax = int(counts.max())
    offs = torch.cumsum(counts, 0) - counts
    # slot in the row-major [m, cmax] matrix: position in flat order, shifted by the row's offset
    shift = torch.arange(m, device=dev).mul_(cmax).sub_(offs)
    slot = torch.arange(flat.numel(), device=dev).add_(shift.index_select(0, rows))
    cand = torch.full((m * cmax,), _BELOW_ALL, dtype=vals.dtype, device=dev)
    cand.scatter_(0, slot, vals)
    v = torch.topk(cand.view(m, cmax), k, dim=1, sorted=False).values.amin(dim=1)  # padding is never chosen
    vr = v.index_select(0, rows)
    keep = vals >= vr  # >= k per row; exactly k in every row iff m*k in all (no ties at v: the usual case)
    if int(keep.sum()) == m * k:
        return flat.index_select(0, keep.nonzero().squeeze(1))
    gt = vals > vr
    eq = vals == vr
    need = k - torch.bincount(rows[gt], minlength=m)  # entries still wanted at the k-th magnitude
    eqi = eq.to(torch.int64)
    rank = torch.cumsum(eqi, 0) - eqi  # equal entries before this one, over all rows
    base = rank.index_select(0, offs)  # ... before this row (every row has >= k >= 1 candidates)
    keep = gt | (eq & ((rank - base.index_select(0, rows)) < need.index_select(0, rows)))
    out = flat.index_select(0, keep.nonzero().squeeze(1))
    if out.numel() != m * k:
        raise RuntimeError(f"exact top-k selected {out.numel()} entries instead of {m * k} (internal error)")
    return out


def _kth_largest(a: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th largest entry of every row of ``a`` (1-D: a scalar), NaN-free.

    ``torch.topk`` of the smaller side: on CPU it is several times faster than ``torch.kthvalue``.
    """
    n = a.shape[-1]
    if n - k + 1 < k:
        return torch.topk(a, n - k + 1, dim=-1, largest=False, sorted=False).values.amax(dim=-1)
    return torch.topk(a, k, dim=-1, sorted=False).values.amin(dim=-1)


def _exact_rows(X: torch.Tensor, k: int) -> torch.Tensor:
    """Exact path: the k-th largest magnitude of every whole row, then step 3 over the row."""
    m, bs = X.shape
    a = X.abs().nan_to_num_(nan=_BELOW_ALL)  # NaN ranks below every number
    v = _kth_largest(a, k)
    gt = a > v[:, None]
    eq = a == v[:, None]
    need = k - gt.sum(1)
    keep = gt | (eq & (torch.cumsum(eq, 1) <= need[:, None]))
    cols = torch.nonzero(keep)[:, 1]
    return cols.view(m, k)
