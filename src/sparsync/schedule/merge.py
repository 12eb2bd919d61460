"""Merge plans: which consecutive gradient tensors travel together as one message (MG-WFBP: Shi, Chu & Li,
INFOCOM 2019).

Everything here works in **backward order**: index 0 is the first tensor whose gradient is ready
(the paper's layer ``L``), index ``L-1`` the last (layer 1). A plan is a list of half-open ranges
``(start, end)`` covering ``0..L`` in order; each range is one message (one reducer call).

Timeline model. With ``t_b[k]`` the backward time of
tensor ``k`` and ``C[k] = t_b[0] + ... + t_b[k]`` its ready time (forward time excluded, as in
Algorithm 1), a group ``[i, j)`` of ``S = sizes[i] + ... + sizes[j-1]`` bytes starts at
``max(finish of previous group, C[j-1])`` and takes ``a + b*S``. The predicted iteration time
(without forward) is the last group's finish; the non-overlapped communication is that minus
``C[L-1]`` (the backward time).

Strategies (all take the same inputs: ``t_b``, ``sizes`` in bytes, ``a``, ``b``):

* ``wfbp``: one message per tensor (eqs. 6-8).
* ``single``: one message after backward (SyncEASGD, eq. 9).
* ``buckets:<MB>``: fill a bucket in backward order and close it once it holds >= MB MiB (DDP's
  ``bucket_cap_mb``; the model is not consulted).
* ``mgwfbp``: the paper's Algorithm 1, verbatim, O(L^2). Not always optimal.
* ``optimal``: the exact dynamic program of the paper's §4.1,
  ``F[j] = min_{i<j} max(F[i], C[j-1]) + a + b*S(i, j)``, O(L^2) (vectorised over ``i``).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

import numpy as np

__all__ = [
    "STRATEGIES",
    "brute_force",
    "check_plan",
    "evaluate",
    "make_plan",
    "parse_strategy",
    "plan_buckets",
    "plan_mgwfbp",
    "plan_optimal",
    "plan_single",
    "plan_wfbp",
]

STRATEGIES = ("wfbp", "single", "buckets:25", "mgwfbp", "optimal")

Groups = list[tuple[int, int]]


def _arrays(t_b, sizes):
    t_b = np.asarray(t_b, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    if t_b.ndim != 1 or sizes.shape != t_b.shape:
        raise ValueError(f"t_b and sizes must be 1-D of equal length, got {t_b.shape} and {sizes.shape}")
    if len(t_b) == 0:
        raise ValueError("a plan needs at least one tensor")
    if (t_b < 0).any() or (sizes < 0).any() or not np.isfinite(t_b).all():
        raise ValueError("backward times and sizes must be finite and non-negative")
    return t_b, sizes


def check_plan(groups: Sequence[tuple[int, int]], L: int) -> Groups:
    """Validate that ``groups`` are consecutive non-empty ranges covering ``0..L``."""
    groups = [(int(i), int(j)) for i, j in groups]
    pos = 0
    for i, j in groups:
        if i != pos or j <= i:
            raise ValueError(f"plan {groups} is not a sequence of consecutive non-empty ranges covering 0..{L}")
        pos = j
    if pos != L:
        raise ValueError(f"plan {groups} covers 0..{pos}, expected 0..{L}")
    return groups


def evaluate(groups, t_b, sizes, a: float, b: float, t_f: float = 0.0) -> dict:
    """Predicted timeline of a plan: iteration time, non-overlapped communication, per-group times."""
    t_b, sizes = _arrays(t_b, sizes)
    groups = check_plan(groups, len(t_b))
    ready = np.cumsum(t_b)
    finish = 0.0
    starts, finishes = [], []
    for i, j in groups:
        start = max(finish, ready[j - 1])
        finish = start + a + b * float(sizes[i:j].sum())
        starts.append(start)
        finishes.append(finish)
    backward = float(ready[-1])
    return {
        "iteration_s": t_f + finish,
        "backward_s": backward,
        "comm_s": sum(f - s for s, f in zip(starts, finishes)),
        "non_overlapped_s": finish - backward,
        "groups": len(groups),
        "group_start_s": starts,
        "group_finish_s": finishes,
    }


def plan_wfbp(L: int) -> Groups:
    return [(k, k + 1) for k in range(L)]


def plan_single(L: int) -> Groups:
    return [(0, L)]


def plan_buckets(sizes, cap_bytes: float) -> Groups:
    """Close a bucket as soon as it holds at least ``cap_bytes`` (DDP's rule)."""
    if not cap_bytes > 0:
        raise ValueError(f"bucket size must be positive, got {cap_bytes}")
    groups, start, acc = [], 0, 0.0
    for k, s in enumerate(sizes):
        acc += float(s)
        if acc >= cap_bytes:
            groups.append((start, k + 1))
            start, acc = k + 1, 0.0
    if start < len(sizes):
        groups.append((start, len(sizes)))
    return groups


def plan_mgwfbp(t_b, sizes, a: float, b: float) -> Groups:
    """The paper's Algorithm 1, line by line, in its 1-indexed layer numbering.

    Layer ``l`` is tensor ``L - l`` in backward order. ``merged[l]`` means layer ``l``'s gradient is
    appended to layer ``l-1``'s message; a message closes at every normal layer.
    """
    t_b_, p_ = _arrays(t_b, sizes)
    L = len(t_b_)
    p = [0.0] * (L + 1)
    tb = [0.0] * (L + 1)
    for k in range(L):
        p[L - k] = float(p_[k])
        tb[L - k] = float(t_b_[k])
    t_c = [0.0] + [a + b * p[layer] for layer in range(1, L + 1)]
    tau_b = [0.0] * (L + 1)
    tau_b[L] = 0.0
    for layer in range(L - 1, 0, -1):
        tau_b[layer] = tau_b[layer + 1] + tb[layer + 1]

    def comm_start():
        tau_c = [0.0] * (L + 1)
        tau_c[L] = tau_b[L] + tb[L]
        for layer in range(L - 1, 0, -1):
            tau_c[layer] = max(tau_c[layer + 1] + t_c[layer + 1], tau_b[layer] + tb[layer])
        return tau_c

    tau_c = comm_start()
    merged = [False] * (L + 1)
    for layer in range(L, 1, -1):
        if tau_b[layer - 1] + tb[layer - 1] - tau_c[layer] < a:  # eq. (38)
            t_c[layer] = 0.0
            p[layer - 1] += p[layer]
            t_c[layer - 1] = a + b * p[layer - 1]
            tau_c = comm_start()
            merged[layer] = True
    groups, start = [], 0
    for k in range(L):
        if not merged[L - k]:  # a normal layer sends everything buffered so far
            groups.append((start, k + 1))
            start = k + 1
    return groups


def optimal_table(t_b, sizes, a: float, b: float) -> tuple[list[float], list[list[tuple[int, float, float]]]]:
    """The DP of :func:`plan_optimal` with every option: ``(F, options)``.

    ``F[j]`` = earliest finish of the first ``j`` tensors' messages when a group ends at ``j-1``;
    ``options[j]`` = ``[(i, units, finish), ...]`` for every ``i < j`` (group = tensors ``i..j-1``),
    ``F[j] = min_i finish``.
    """
    t_b, sizes = _arrays(t_b, sizes)
    L = len(t_b)
    ready = np.cumsum(t_b)
    pref = np.concatenate([[0.0], np.cumsum(sizes)])
    F = np.zeros(L + 1)
    options: list[list[tuple[int, float, float]]] = [[]]
    for j in range(1, L + 1):
        units = pref[j] - pref[:j]
        cand = np.maximum(F[:j], ready[j - 1]) + a + b * units
        F[j] = cand.min()
        options.append([(i, float(units[i]), float(cand[i])) for i in range(j)])
    return F.tolist(), options


def plan_optimal(t_b, sizes, a: float, b: float) -> Groups:
    """Exact minimum of the predicted iteration time over all contiguous groupings.

    ``F[j] = min_{i<j} max(F[i], C[j-1]) + a + b*(P[j] - P[i])`` with prefix sums ``P``
    (:func:`optimal_table`). A group's start is monotone in the previous finish, so keeping the
    minimum per boundary is exact. Ties go to the largest ``i`` (deterministic, so every rank
    computes the same plan).
    """
    _, options = optimal_table(t_b, sizes, a, b)
    groups, j = [], len(options) - 1
    while j > 0:
        cand = [fin for _, _, fin in options[j]]
        i = max(range(j), key=lambda x: (-cand[x], x))  # last index attaining the minimum
        groups.append((i, j))
        j = i
    return groups[::-1]


def brute_force(t_b, sizes, a: float, b: float) -> tuple[Groups, float]:
    """Best plan by enumerating all ``2^(L-1)`` contiguous groupings (tests only; L <= ~14)."""
    t_b, sizes = _arrays(t_b, sizes)
    L = len(t_b)
    best, best_t = None, math.inf
    for cuts in itertools.product((False, True), repeat=L - 1):
        groups, start = [], 0
        for k, cut in enumerate(cuts):
            if cut:
                groups.append((start, k + 1))
                start = k + 1
        groups.append((start, L))
        t = evaluate(groups, t_b, sizes, a, b)["iteration_s"]
        if t < best_t:
            best, best_t = groups, t
    return best, best_t


def parse_strategy(strategy: str) -> tuple[str, float | None]:
    """``"buckets:25"`` -> ``("buckets", 25*2**20)``; other names -> ``(name, None)``."""
    if not isinstance(strategy, str):
        raise ValueError(f"merge strategy must be a string, got {strategy!r}")  # noqa: TRY004
    m = re.fullmatch(r"buckets(?::([0-9]*\.?[0-9]+))?", strategy)
    if m:
        mb = float(m.group(1)) if m.group(1) else 25.0
        if mb <= 0:
            raise ValueError(f"bucket size must be positive in {strategy!r}")
        return "buckets", mb * 2**20
    if strategy in ("wfbp", "single", "mgwfbp", "optimal"):
        return strategy, None
    raise ValueError(f"unknown merge strategy {strategy!r}; valid: wfbp, single, buckets:<MB>, mgwfbp, optimal")


def needs_model(strategy: str) -> bool:
    """True for strategies that need backward times and a cost model (mgwfbp, optimal)."""
    return parse_strategy(strategy)[0] in ("mgwfbp", "optimal")


def make_plan(strategy: str, t_b, sizes, a: float = 0.0, b: float = 0.0) -> Groups:
    """The groups of ``strategy`` for these inputs (``t_b`` may be None for model-free strategies)."""
    kind, cap = parse_strategy(strategy)
    L = len(sizes)
    if kind == "wfbp":
        return plan_wfbp(L)
    if kind == "single":
        return plan_single(L)
    if kind == "buckets":
        return plan_buckets(sizes, cap)
    if t_b is None:
        raise ValueError(f"merge strategy {strategy!r} needs per-tensor backward times")
    if kind == "mgwfbp":
        return plan_mgwfbp(t_b, sizes, a, b)
    return plan_optimal(t_b, sizes, a, b)
