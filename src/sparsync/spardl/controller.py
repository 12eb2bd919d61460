"""B-SAG compression-ratio controller, SparDL Algorithm 2 (``spec/spardl.md`` §7.2).

State ``h`` (pre-selection size), ``step``, ``flag``; ``L = d k / P``. Order (implementation choice of
the spec, = reference snapshot): the first B-SAG runs with ``h = k/P``; after each B-SAG the measured
``N_t`` (distinct nonzero indices after the all-gather sum) drives::

    if (N_t > L) XOR (step > 0):   # still the right direction
        if flag: step *= 2; flag = False     else: flag = True
    else:                          # wrong direction: reverse and halve
        step = -step / 2; flag = False
    h = h + step

Too many gradients (``N_t > L``) moves ``h`` down — the algorithm, not the paper's prose
([ERRATUM]). ``h`` and ``step`` are floats; the size actually used is
``clamp(round(h), ceil(k/P), L)`` (:attr:`h_used`). Every member of a B-SAG group sees the same
``N_t``, so their controllers stay identical. Trace: ``spec/worked-examples.md`` §4.
"""

from __future__ import annotations

import math

__all__ = ["HController"]


class HController:
    def __init__(self, P: int, d: int, k: int, L: int | None = None):
        self.P, self.d, self.k = int(P), int(d), int(k)
        self.L = int(L) if L is not None else max(1, (self.d * self.k) // self.P)
        self.h = self.k / self.P
        self.step = 0.01 * self.k * (self.d - 1) / self.P
        self.flag = False
        self.h_min = min(self.L, max(1, math.ceil(self.k / self.P)))

    @property
    def h_used(self) -> int:
        return int(min(self.L, max(self.h_min, round(self.h))))

    def update(self, n_t: int) -> None:
        if (n_t > self.L) != (self.step > 0):
            if self.flag:
                self.step = 2 * self.step
                self.flag = False
            else:
                self.flag = True
        else:
            self.step = -self.step / 2
            self.flag = False
        self.h = self.h + self.step

    def state(self) -> dict:
        return {"h": self.h, "step": self.step, "flag": self.flag}

    def load(self, s: dict) -> None:
        self.h, self.step, self.flag = float(s["h"]), float(s["step"]), bool(s["flag"])
