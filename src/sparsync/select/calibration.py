"""The window of candidate thresholds of MiCRO's per-step calibration (``micro``'s default rule).

Contract: :class:`ThresholdWindow` holds where the next step's ``bins + 1`` log-spaced candidate
thresholds lie - a centre and a spread ``s``, the candidates being ``center * s ** (2j/bins - 1)``
(:func:`~sparsync.select.threshold.calibration_edges`). It communicates nothing and reads no
gradient except in :meth:`ThresholdWindow.local_estimate`; every rank that feeds it the same values
(the chosen threshold and edge, the all-gathered estimates) holds the same window, so the ranks
keep choosing one global threshold. The choice itself (the global count at every candidate,
:func:`~sparsync.select.threshold.local_histogram`, :func:`~sparsync.select.threshold.choose_edge`)
and the communication-free feedback rules (:class:`~sparsync.select.threshold.ThresholdController`)
live in :mod:`.threshold`.

* Steady state: the centre is the last threshold moved on by the last step's trend,
  ``delta_t * (delta_t / delta_{t-1}) ** lead`` (ratio clamped to [1/4, 4]): with error feedback
  and momentum the threshold drifts steadily, and a window centred on the last value lags.
* The spread squares (up to ``max_spread``) when the chosen edge is an end of the window (the
  target may lie outside) and moves back towards ``spread`` otherwise.
* First steps (``start="data"``, no threshold given): before two thresholds give a trend, each rank
  estimates its share's threshold from a fixed sample (:meth:`~ThresholdWindow.local_estimate`)
  and the window spans every rank's estimate (:meth:`~ThresholdWindow.center_from_estimates`).

The rule is this project's (MiCRO, Yoon & Oh, leaves the threshold estimate open); why and what it
achieves: ``docs/micro.md``, "The threshold rule".
"""

from __future__ import annotations

import math

import torch

from .threshold import calibration_edges

__all__ = ["ThresholdWindow"]


class ThresholdWindow:
    """Centre and spread of the calibration window, and the state that moves them (see the module)."""

    def __init__(self, spread: float = 1.1, max_spread: float = 4.0, bins: int = 128, lead: float = 0.7,
                 what: str = "micro"):
        calibration_edges(1.0, spread, bins)  # validates spread > 1 and bins >= 1
        if isinstance(bins, bool) or int(bins) != bins:
            raise ValueError(f"{what}: bins must be an integer >= 1, got {bins!r}")
        if not float(max_spread) >= float(spread):
            raise ValueError(f"{what}: max_spread must be >= spread, got {max_spread!r} < {spread!r}")
        try:
            lead_f = float(lead)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: lead must be a number in [0, 1], got {lead!r}") from None
        if not 0.0 <= lead_f <= 1.0:
            raise ValueError(f"{what}: lead must be a number in [0, 1], got {lead!r}")
        self.spread, self.max_spread, self.bins, self.lead = float(spread), float(max_spread), int(bins), lead_f
        self.spread_now = self.spread
        self.data_windows_left = 0  # steps whose window is still centred on sampled data (start="data")
        self.prev_threshold: float | None = None  # the threshold chosen one step before the last
        self.trend = 1.0  # ratio of the last two chosen thresholds: the next window's lead

    def start_blind(self, data: bool) -> None:
        """The first threshold is a data-blind guess: the widest window first, and with ``data`` the
        first two windows centred on sampled estimates instead (until two thresholds give a trend)."""
        if data:
            self.data_windows_left = 2
        self.spread_now = self.max_spread

    def take_data_window(self) -> bool:
        """True (and counted) when this step's window is to be centred on sampled data."""
        if self.data_windows_left:
            self.data_windows_left -= 1
            return True
        return False

    def center(self, delta: float) -> float:
        """Steady state: ``delta`` (the last threshold) moved on by the last step's trend."""
        return delta * min(4.0, max(0.25, self.trend)) ** self.lead

    def edges(self, center: float, dtype=torch.float32, device="cpu") -> torch.Tensor:
        """The ``bins + 1`` candidate thresholds of this step's window."""
        return calibration_edges(center, self.spread_now, self.bins, dtype, device)

    @staticmethod
    def local_estimate(acc: torch.Tensor, start: int, end: int, target: int, world_size: int, rank: int) -> float:
        """This rank's estimate of the threshold that passes its share ``target / world_size`` of
        ``acc[start:end]`` (0.0: none), from a fixed pseudo-random sample of ``m >= 65536`` entries
        with >= 256 expected above the estimate (seeded by ``rank``: the same on every run)."""
        P, L = world_size, end - start
        share = min(1.0, target / P / max(L, 1))
        if L <= 0 or share >= 1.0:
            return 0.0
        m = min(L, max(1 << 16, math.ceil(256 / max(share, 1e-12))))
        g = torch.Generator(device="cpu").manual_seed(12345 + rank)
        pos = torch.randint(start, end, (m,), generator=g).to(acc.device)
        sample = acc.index_select(0, pos).abs_().float()
        kth = max(1, min(m, m - int(share * m)))  # kth smallest = the (1 - share) quantile
        return float(sample.kthvalue(kth).values)

    def center_from_estimates(self, estimates: list[float], delta: float) -> float:
        """The window from every rank's :meth:`local_estimate` (the same list on every rank): centred on
        the geometric mean of the lowest and highest, wide enough to hold both with a 20 % margin for
        the sampling error. Without any usable estimate (every sample all zero): the widest window
        around ``delta``."""
        usable = [e for e in estimates if e > 0.0 and math.isfinite(e)]  # 0: an all-zero sample
        if not usable:
            self.spread_now = self.max_spread
            return delta
        lo, hi = min(usable), max(usable)
        self.spread_now = min(self.max_spread, max(self.spread, 1.2 * math.sqrt(hi / lo)))
        return math.sqrt(lo * hi)

    def chose(self, delta: float, j: int) -> None:
        """The step chose edge ``j``, threshold ``delta``: the trend follows, and the spread squares
        (up to ``max_spread``) when ``j`` is an end of the window, else moves back towards ``spread``."""
        self.trend = 1.0 if self.prev_threshold is None else delta / self.prev_threshold
        self.prev_threshold = delta
        if j in (0, self.bins):
            self.spread_now = min(self.max_spread, self.spread_now ** 2)
        else:
            self.spread_now = max(self.spread, math.sqrt(self.spread_now))

    def state_dict(self) -> dict:
        return {"spread": self.spread_now, "prev_threshold": self.prev_threshold, "trend": self.trend,
                "data_windows_left": self.data_windows_left}

    def load_state_dict(self, d: dict) -> None:
        self.spread_now = float(d.get("spread", self.spread))
        self.prev_threshold = d.get("prev_threshold")
        self.trend = float(d.get("trend", 1.0))
        self.data_windows_left = int(d.get("data_windows_left", 0))
