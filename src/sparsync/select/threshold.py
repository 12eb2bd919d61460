"""Threshold selection, MiCRO's partitioned threshold selection, and the threshold controller.

What: the selection kernels behind the ``hard_threshold`` and ``micro`` reducers
(MiCRO: Yoon & Oh, "MiCRO: Near-Zero Cost Gradient Sparsification for Scaling and Accelerating
Distributed DNN Training", 2023, §IV):

* :func:`threshold_indices` - every index with ``|x[i]| >= delta`` (sorted int64).
* :func:`partition_bounds` / :func:`owned_partition` - MiCRO's coarse-grained contiguous partitions
  (the first ``n_g mod P`` parts are one element longer; the paper leaves the remainder open) and the cyclic
  assignment ``part = (t mod P + rank) mod P`` (Algorithm 1 line 7).
* :func:`partitioned_threshold_select` - threshold selection restricted to one partition, with an
  optional per-partition budget (``cap``) that bounds the message when the threshold is far too low.
* :class:`ThresholdController` - the threshold-scaling rule (``Estimate`` of Algorithm 1 line 13).

Why: on a CPU an exact ``torch.topk`` over ``n`` entries costs about as much as a dense all-reduce
of ``n`` floats at 1 Gbit/s; a threshold test is one streaming pass (MiCRO's "near-zero cost"). The kernel here
is tuned for that: it never materialises a boolean mask the size of the input (torch's comparison
into ``bool`` and ``torch.nonzero`` over a byte mask are the slow parts on CPU); instead it works on
cache-sized chunks (``CHUNK`` elements) of a reusable float workspace::

    w     = |x[chunk]|            (torch.abs into the workspace)
    w     = (w >= delta)          (in-place ge_: 1.0 / 0.0, same buffer)
    pairs = nonzero(w viewed as int64)      # one 64-bit word holds two float flags: half the work
    idx   = 2*pairs + nonzero(w.view(-1, 2)[pairs])[:, 1]

Results are identical to the naive ``nonzero(x.abs() >= delta)`` (tested); ``sparsync bench-select
--parts selection`` times the two side by side.

For contiguous fp32 on the CPU the same indices come from a C loop instead
(:mod:`sparsync.native`, when it builds); this torch kernel serves every other
case and machines without a C compiler.

NaN entries never pass the threshold (``NaN >= delta`` is false) - they stay in the residual.
"""

from __future__ import annotations

import math

import torch

from .. import native
from .exact import topk_indices

__all__ = [
    "CHUNK",
    "ThresholdController",
    "Workspace",
    "calibration_edges",
    "check_threshold",
    "choose_edge",
    "initial_threshold",
    "keep_largest",
    "local_histogram",
    "owned_partition",
    "partition_bounds",
    "partition_owner",
    "partitioned_threshold_select",
    "threshold_indices",
    "threshold_select",
]

#: elements per chunk of the threshold kernel (1 Mi floats = 4 MiB: stays in the last-level cache)
CHUNK = 1 << 20


def check_threshold(delta, what: str = "threshold") -> float:
    """A selection threshold must be a finite number > 0."""
    try:
        d = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a positive finite number, got {delta!r}") from None
    if not (d > 0.0) or not math.isfinite(d):
        raise ValueError(f"{what} must be a positive finite number, got {delta!r}")
    return d


def initial_threshold(k: int) -> float:
    """``delta_0 = 1 / (2 sqrt(k))``: the initial value of the MiCRO authors' published code (the paper gives none)."""
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return 1.0 / (2.0 * math.sqrt(k))


class Workspace:
    """A reusable float buffer for the threshold kernel (avoids a fresh allocation every step)."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def get(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        b = self._buf
        if b is None or b.numel() < numel or b.dtype != dtype or b.device != torch.device(device):
            b = self._buf = torch.empty(numel, dtype=dtype, device=device)
        return b[:numel]


def _check_1d_float(x, what):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} needs a tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{what} needs a 1-D tensor, got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{what} needs a floating-point tensor, got {x.dtype}")


def threshold_indices(x: torch.Tensor, delta: float, *, chunk: int = CHUNK,
                      workspace: Workspace | None = None, offset: int = 0) -> torch.Tensor:
    """Sorted int64 indices ``i`` with ``|x[i]| >= delta`` (plus ``offset``).

    About one read of ``x`` and cache-resident work per chunk (see the module docstring). On CUDA
    the plain fused form ``nonzero(|x| >= delta)`` is used (one kernel pair, already fast there).
    """
    _check_1d_float(x, "threshold_indices")
    delta = check_threshold(delta)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if native.usable(x):  # the C compaction: same indices, one pass (sparsync.native)
        return native.compact_abs_ge(x, delta, offset)
    if x.device.type != "cpu" or x.element_size() != 4:
        return torch.nonzero(x.abs() >= delta).squeeze(1) + offset
    chunk = max(2, int(chunk) & ~1)
    ws = workspace.get(min(n, chunk) + 1, x.dtype, x.device) if workspace else \
        torch.empty(min(n, chunk) + 1, dtype=x.dtype, device=x.device)
    if ws.storage_offset() % 2:  # the int64 view needs 8-byte alignment
        ws = torch.empty(ws.numel(), dtype=x.dtype, device=x.device)
    outs = []
    for s in range(0, n, chunk):  # loop over cache-sized blocks, not elements
        e = min(n, s + chunk)
        L = e - s
        Le = L + (L & 1)
        w = ws[:Le]
        torch.abs(x[s:e], out=w[:L])
        if Le != L:
            w[L] = -1.0  # pad to an even length; never passes (delta > 0)
        w.ge_(delta)
        words = torch.nonzero(w.view(torch.int64)).squeeze(1)
        if words.numel() == 0:
            continue
        ij = torch.nonzero(w.view(-1, 2).index_select(0, words))  # index_select: a third of []'s time
        outs.append(words.index_select(0, ij[:, 0]).mul_(2).add_(ij[:, 1]).add_(s + offset))
    if not outs:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def threshold_select(x: torch.Tensor, delta: float, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, x[indices])`` for ``|x| >= delta`` (indices sorted ascending)."""
    idx = threshold_indices(x, delta, **kw)
    return idx, x.index_select(0, idx)


# ---------------------------------------------------------------------- MiCRO partitions
def partition_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` contiguous partitions (MiCRO §IV).

    ``q, rem = divmod(numel, parts)``; partition ``p`` has ``q + 1`` elements if ``p < rem`` else ``q``.
    """
    numel, parts = int(numel), int(parts)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    q, rem = divmod(numel, parts)
    out, start = [], 0
    for p in range(parts):
        size = q + 1 if p < rem else q
        out.append((start, start + size))
        start += size
    return out


def owned_partition(rank: int, step: int, world_size: int) -> int:
    """Partition owned by ``rank`` at ``step``: ``(step mod P + rank) mod P`` (Algorithm 1 line 7)."""
    return (int(step) % world_size + int(rank)) % world_size


def partition_owner(part: int, step: int, world_size: int) -> int:
    """Rank that owns partition ``part`` at ``step`` (inverse of :func:`owned_partition`)."""
    return (int(part) - int(step)) % world_size


def partitioned_threshold_select(acc: torch.Tensor, delta: float, start: int, end: int,
                                 cap: int | None = None, workspace: Workspace | None = None):
    """MiCRO's exclusive selection: global indices in ``[start, end)`` with ``|acc| >= delta``.

    Only ``acc[start:end]`` is read (``O(n/P)``). ``cap`` bounds the count: when more entries pass,
    the ``cap`` of largest magnitude among them are kept (a top-k over the candidates only; the
    rest stay in the residual). Returns ``(indices sorted int64, passed)`` where ``passed`` is the
    number that crossed the threshold before capping.
    """
    if not 0 <= start <= end <= acc.numel():
        raise ValueError(f"partition [{start}, {end}) is outside [0, {acc.numel()})")
    idx = threshold_indices(acc[start:end], delta, workspace=workspace, offset=start)
    passed = idx.numel()
    if cap is not None and passed > cap:
        idx = keep_largest(idx, acc.index_select(0, idx).abs_(), cap)
    return idx, passed


def keep_largest(idx: torch.Tensor, absvals: torch.Tensor, cap: int) -> torch.Tensor:
    """The ``cap`` indices of largest ``absvals`` (sorted ascending); all of them if fewer.

    ``idx`` ascending; ties go to the lower indices (:func:`sparsync.select.exact.topk_indices`).
    """
    cap = max(0, int(cap))
    if idx.numel() <= cap:
        return idx
    return idx[topk_indices(absvals, cap)]


# ---------------------------------------------------------------------- per-step calibration
def calibration_edges(center: float, spread: float, bins: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """``bins + 1`` log-spaced thresholds ``center * spread ** (2j/bins - 1)``, ``j = 0..bins``.

    Computed in float64 from Python floats, then cast to the gradient's dtype, so every rank gets
    bitwise the same edges and the later comparisons are exact in that dtype.
    """
    if not float(spread) > 1.0:
        raise ValueError(f"spread must be > 1, got {spread!r}")
    if int(bins) < 1:
        raise ValueError(f"bins must be >= 1, got {bins!r}")
    j = torch.arange(int(bins) + 1, dtype=torch.float64)
    e = float(center) * float(spread) ** (2.0 * j / int(bins) - 1.0)
    return e.to(dtype=dtype, device=device)


def local_histogram(absvals: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hist, bucket)``: ``bucket[i] = #{edges <= absvals[i]}`` and ``hist`` its counts (``len(edges) + 1``).

    ``sum(hist[j + 1:])`` is the number of values ``>= edges[j]``. The edges are log-spaced
    (:func:`calibration_edges`), so the bucket is computed from ``log(v / edges[0])`` and then
    corrected by one exact comparison with the neighbouring edges (the float rounding of the log is
    far below one bin) - cheaper than ``torch.bucketize``'s binary search, and exactly equal to it
    (tested).
    """
    B = edges.numel() - 1
    if native.usable(absvals) and edges.dtype == torch.float32 and B >= 1:
        return native.bucket_count(absvals, edges)  # a binary search per value in C: same buckets
    if absvals.numel() == 0 or B < 1 or absvals.dtype not in (torch.float32, torch.float64):
        # low-precision edges may repeat: use the general (slower) search
        bucket = torch.bucketize(absvals, edges, right=True)
        return torch.bincount(bucket, minlength=edges.numel() + 1), bucket
    e0, eB = float(edges[0]), float(edges[-1])
    step = math.log(eB / e0) / B if eB > e0 else 1.0
    j = torch.log(absvals.double() / e0).div_(step).floor_().clamp_(-1, B).to(torch.int64)
    # bucket candidate = j + 1 (v in [e_j, e_{j+1})); fix the rounding with exact comparisons
    padded = torch.cat([edges.new_full((1,), -math.inf), edges, edges.new_full((1,), math.inf)])
    b = j + 1  # in [0, B + 1]; bucket b <=> padded[b] <= v < padded[b + 1]
    b -= (absvals < padded[b]).to(torch.int64)
    b += (absvals >= padded[b + 1]).to(torch.int64)
    b.clamp_(0, B + 1)  # v = inf
    return torch.bincount(b, minlength=edges.numel() + 1), b


def choose_edge(hist: torch.Tensor, target: int) -> tuple[int, int]:
    """``(j, C_j)``: the edge whose count ``C_j = sum(hist[j+1:])`` is closest to ``target``.

    Among equal counts the lowest edge is taken when the count is below the target (so a window
    that selects nothing moves down), the highest otherwise.
    """
    counts = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])[1:]  # C_j for j = 0..bins
    err = (counts - int(target)).abs()
    best = torch.nonzero(err == err.min()).squeeze(1)
    # equal counts select the same entries; for the next window prefer moving toward the target
    j = int(best[0]) if int(counts[best[0]]) < int(target) else int(best[-1])
    return j, int(counts[j])


# ---------------------------------------------------------------------- threshold scaling
#: The ``"micro"`` rule's constants, copied from the MiCRO authors' published code (the paper gives no
#: formula; not re-derived): the +-10 % band around the target (``0.909 = 1 / 1.1``) and the factors above,
#: inside and below it (at most 0.5 % per step; inside the band a slight upward drift).
_MICRO_BAND = (0.909, 1.1)
_MICRO_FACTORS = (1.005, 1.00125, 0.995)


class ThresholdController:
    """Scales the selection threshold every step so the selected count tracks ``target``.

    Hyperparameters first; the state (``delta`` and, for the adaptive rule, the current step size
    and direction) is a few floats, so it pickles without any process group and stays identical on
    every rank as long as every rank feeds it the same count (MiCRO feeds the global count
    ``K_t = |idx_t|`` that every rank knows after the index all-gather).

    Why a controller at all, and why this one: with error feedback the count responds to the
    threshold in two ways. In steady state it falls like ``1/delta`` (an entry is sent once its
    accumulated value reaches ``delta``, taking ~``1/density`` steps), but right after a change the
    response is ~``1/density`` times steeper (lowering ``delta`` by 1% releases every accumulator
    that sat within 1% of it - at density 1% that doubles the count). A fixed-gain rule is
    therefore either slow (the authors' 0.5% steps) or oscillates (a proportional rule with a
    useful gain). The default ``"adaptive"`` rule adapts its step size instead (Rprop-style, as
    SparDL's B-SAG ``h`` adjustment, Zhao et al. 2023, Algorithm 2): fast when far from the target, fine once
    the count starts to alternate around it.

    Rules, with ``rho = count / target``:

    * ``"adaptive"`` (default): in log space, ``direction = sign(rho - 1)`` (0 when
      ``|rho - 1| <= band``); the step grows by ``grow`` while the direction repeats and shrinks by
      ``shrink`` when it reverses, within ``[min_step, log(max_step)]``;
      ``delta *= exp(direction * step)``. Initial step ``log(max_step) / 4``.
    * ``"proportional"``: ``delta *= clip(rho ** gamma, 1/max_step, max_step)`` (``1/max_step``
      when nothing was selected; no change inside the band). Stable only for small ``gamma``.
    * ``"micro"``: the MiCRO authors' published code, for reproduction::

          factor = 1.005 if rho > 1.1;  1.00125 if 0.909 < rho <= 1.1;  0.995 if rho <= 0.909

      At most 0.5% per step: from ``delta_0 = 1/(2 sqrt(k))`` it needs hundreds of steps whenever
      the gradient scale is off by more than ~30%.
    """

    RULES = ("adaptive", "proportional", "micro")

    def __init__(self, target: int, delta: float, rule: str = "adaptive", gamma: float = 0.5,
                 max_step: float = 2.0, band: float = 0.02, min_step: float = 1e-3, grow: float = 1.5,
                 shrink: float = 0.5):
        if rule not in self.RULES:
            raise ValueError(f"threshold rule must be one of {', '.join(self.RULES)}, got {rule!r}")
        if int(target) < 1:
            raise ValueError(f"target count must be >= 1, got {target}")
        if not (0.0 < float(gamma) <= 2.0):
            raise ValueError(f"gamma must be in (0, 2], got {gamma!r}")
        if not (float(max_step) > 1.0) or not math.isfinite(float(max_step)):
            raise ValueError(f"max_step must be a finite number > 1, got {max_step!r}")
        if not (0.0 <= float(band) < 1.0):
            raise ValueError(f"band must be in [0, 1), got {band!r}")
        if not (0.0 < float(min_step) <= math.log(float(max_step))):
            raise ValueError(f"min_step must be in (0, log(max_step)], got {min_step!r}")
        if not (float(grow) >= 1.0) or not (0.0 < float(shrink) < 1.0):
            raise ValueError(f"need grow >= 1 and 0 < shrink < 1, got grow={grow!r}, shrink={shrink!r}")
        self.target = int(target)
        self.rule = rule
        self.gamma = float(gamma)
        self.max_step = float(max_step)
        self.band = float(band)
        self.min_step = float(min_step)
        self.grow = float(grow)
        self.shrink = float(shrink)
        self.delta = check_threshold(delta, "initial threshold")
        self.step = math.log(self.max_step) / 4  # adaptive rule: current |log step|
        self.direction = 0  # adaptive rule: last non-zero direction

    def factor(self, count: int) -> float:
        """Multiplier applied to ``delta`` after a step that selected ``count`` entries (pure)."""
        rho = int(count) / self.target
        if self.rule == "micro":
            if rho > _MICRO_BAND[1]:
                return _MICRO_FACTORS[0]
            return _MICRO_FACTORS[1] if rho > _MICRO_BAND[0] else _MICRO_FACTORS[2]
        if abs(rho - 1.0) <= self.band:
            return 1.0
        if self.rule == "adaptive":
            return math.exp((1 if rho > 1 else -1) * self._next_step(1 if rho > 1 else -1))
        if count <= 0:
            return 1.0 / self.max_step
        return min(self.max_step, max(1.0 / self.max_step, rho ** self.gamma))

    def _next_step(self, direction: int) -> float:
        if self.direction == 0 or direction == self.direction:
            s = self.step * (self.grow if self.direction else 1.0)
        else:
            s = self.step * self.shrink
        return min(math.log(self.max_step), max(self.min_step, s))

    def update(self, count: int) -> float:
        """Feed the last step's count; returns the threshold for the next step."""
        f = self.factor(count)
        if self.rule == "adaptive" and f != 1.0:
            direction = 1 if f > 1.0 else -1
            self.step = abs(math.log(f))
            self.direction = direction
        d = self.delta * f
        self.delta = min(max(d, 1e-30), 1e30)  # a positive finite float whatever happens
        return self.delta

    def state_dict(self) -> dict:
        return {"target": self.target, "delta": self.delta, "step": self.step, "direction": self.direction,
                "rule": self.rule}

    def load_state_dict(self, d: dict) -> None:
        self.target = int(d["target"])
        self.delta = float(d["delta"])
        self.step = float(d.get("step", self.step))
        self.direction = int(d.get("direction", 0))

    def __repr__(self) -> str:
        return (f"ThresholdController(target={self.target}, delta={self.delta:.6g}, rule={self.rule!r}, "
                f"step={self.step:.4g})")
