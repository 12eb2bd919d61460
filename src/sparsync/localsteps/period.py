"""``sync_every="auto"``: the synchronisation period of :class:`~.diloco.DiLoCo`, chosen from measured times.

With a period of H local steps, the time per step is ``t_c + t_s / H`` (``t_c``: one local step's
compute; ``t_s``: one synchronisation) and the steps to a target are ``m(H) = 1 + c (H - 1)`` times
those of synchronising every step: the first-order term of local SGD's extra error, which grows with
the number of local steps between two averagings (Stich, "Local SGD Converges Fast and Communicates
Little", ICLR 2019; Wang & Joshi, "Adaptive Communication Strategies to Achieve the Best Error-Runtime
Trade-off in Local-Update SGD", SysML 2019, whose AdaComm chooses the period from the same
trade-off). Time to the target, ``m(H) (t_c + t_s / H)``, is smallest at

    H* = sqrt((1 - c) t_s / (c t_c))

(the better of the two integers around it, in ``[1, max_period]``). The first period is
:data:`START_PERIOD` steps (its local steps measure ``t_c``, its synchronisation ``t_s``: one
synchronisation before the first choice - starting at H = 1 would pay two, a dense exchange over a
slow link each); then H is chosen at every synchronisation from the median local step time since
the previous one and the median of the last three synchronisation times - the maximum over ranks of
both (one all-gather of two numbers), so every rank takes the same H.

``c`` (``period_cost``) is calibrated from measured steps to target of torch's post-local SGD at
several H against synchronous training, on the built-in workloads: the digits MLP with Nesterov SGD
45 steps at H = 8 against 40 (c = 0.018), the transformer with AdamW 1.34x at H = 8 (c = 0.049);
hence :data:`PERIOD_COST` per inner-optimizer family. A workload whose local steps cost more or less
than these passes its own ``period_cost``.
"""

from __future__ import annotations

import math
import statistics

from ..autotune.link import max_and_mean

__all__ = ["PERIOD_COST", "MAX_PERIOD", "START_PERIOD", "AutoPeriod", "best_period", "default_period_cost"]

#: c per inner-optimizer family (module docstring): Adam and its variants, every other optimizer
PERIOD_COST = {"adam": 0.05, "sgd": 0.02}
#: the largest period ``sync_every="auto"`` chooses unless told otherwise
MAX_PERIOD = 64
#: the first period: local steps to time before the first synchronisation
START_PERIOD = 4
_STEPS_KEPT = 16  # local step times kept (the median of those since the last synchronisation, at most these)
_SYNCS_KEPT = 3   # synchronisation times whose median is t_s


def default_period_cost(optimizer) -> float:
    """:data:`PERIOD_COST` for ``optimizer``'s family (Adam, AdamW, ... by class name; else SGD's)."""
    return PERIOD_COST["adam" if "adam" in type(optimizer).__name__.lower() else "sgd"]


def best_period(t_compute: float, t_sync: float, cost: float, max_period: int = MAX_PERIOD) -> int:
    """The integer H in ``[1, max_period]`` that minimises ``(1 + cost (H - 1)) (t_compute + t_sync / H)``."""
    if not (t_compute > 0 and t_sync > 0) or cost >= 1:
        return 1
    if cost <= 0:
        return max_period
    h = math.sqrt((1 - cost) * t_sync / (cost * t_compute))
    around = {min(max_period, max(1, int(math.floor(h)))), min(max_period, max(1, int(math.ceil(h))))}
    return min(sorted(around), key=lambda H: (1 + cost * (H - 1)) * (t_compute + t_sync / H))


class AutoPeriod:
    """The measurements and the choice of ``sync_every="auto"`` (module docstring).

    ``step(seconds)`` records one local step's compute; ``choose(sync_seconds)`` at each
    synchronisation records its time and returns the period to use next, the same on every rank.
    ``timings`` (tests): a callable ``(event dict) -> event dict`` that replaces measured times."""

    def __init__(self, comm, cost: float, max_period: int = MAX_PERIOD):
        if not (isinstance(cost, (int, float)) and 0 <= cost < 1):
            raise ValueError(f"period_cost must be in [0, 1), got {cost!r}")
        if isinstance(max_period, bool) or not isinstance(max_period, int) or max_period < 1:
            raise ValueError(f"max_period must be a positive integer, got {max_period!r}")
        self.comm, self.cost, self.max_period = comm, float(cost), max_period
        self.period = min(START_PERIOD, max_period)
        self.steps: list[float] = []   # local step times since the last synchronisation (the last few)
        self.syncs: list[float] = []   # the last synchronisation times
        self.history: list[dict] = []  # every choice: outer step, period, the times it came from
        self.timings = None

    def step(self, seconds: float) -> None:
        if self.timings is not None:
            seconds = self.timings({"event": "step", "seconds": seconds})["seconds"]
        self.steps = (self.steps + [float(seconds)])[-_STEPS_KEPT:]

    def choose(self, sync_seconds: float, outer_step: int) -> int:
        if self.timings is not None:
            sync_seconds = self.timings({"event": "sync", "seconds": sync_seconds})["seconds"]
        self.syncs = (self.syncs + [float(sync_seconds)])[-_SYNCS_KEPT:]
        mine = [statistics.median(self.steps) if self.steps else 0.0, statistics.median(self.syncs)]
        t_c, t_s = max_and_mean(self.comm, mine, [])[0]
        self.steps = []
        if t_c > 0:  # (a step measured since the last choice: always, unless max_period is 1)
            self.period = best_period(t_c, t_s, self.cost, self.max_period)
        self.history.append({"outer_step": outer_step, "sync_every": self.period,
                             "compute_ms": round(1e3 * t_c, 3), "sync_ms": round(1e3 * t_s, 3)})
        return self.period

    def state_dict(self) -> dict:
        return {"period": self.period, "steps": list(self.steps), "syncs": list(self.syncs),
                "history": list(self.history), "cost": self.cost, "max_period": self.max_period}

    def check_state(self, d) -> int:
        """The period in a saved state (checked with its measurements); a one-line ValueError otherwise."""
        def numbers(v):
            return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)

        p = d.get("period") if isinstance(d, dict) else None
        if (isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= self.max_period
                or not numbers(d.get("steps")) or not numbers(d.get("syncs"))
                or not isinstance(d.get("history"), list)):
            raise ValueError(f"DiLoCo state: the automatic period must hold period (an integer in [1, "
                             f"{self.max_period}]) and the lists steps, syncs, history; got {p!r}")
        return p

    def load_state_dict(self, d: dict) -> None:
        self.period = int(d["period"])
        self.steps, self.syncs = [float(x) for x in d["steps"]], [float(x) for x in d["syncs"]]
        self.history = list(d["history"])
