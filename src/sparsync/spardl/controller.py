"""B-SAG compression-ratio controller, SparDL Algorithm 2 (Zhao et al., ICDE 2024).

State ``h`` (pre-selection size), ``step``, ``flag``; ``L = d k / P``. Order (an implementation choice,
as the reference code): the first B-SAG runs with ``h = k/P``; after each B-SAG the measured
``N_t`` (distinct nonzero indices after the all-gather sum) drives::

    if (N_t > L) XOR (step > 0):   # still the right direction
        if flag: step *= 2; flag = False     else: flag = True
    else:                          # wrong direction: reverse and halve
        step = -step / 2; flag = False
    h = h + step

Too many gradients (``N_t > L``) moves ``h`` down — the algorithm, not the paper's prose. ``h`` and
``step`` are floats. Bounds (the paper leaves them open; implementation choice
``h = clamp(round(h), ceil(k/P), L)``): the *stored* state is clamped, not only
the value used — ``h`` to ``[ceil(k/P), L]`` and ``|step|`` to ``[1, max(1, L - ceil(k/P))]`` — so a
run that keeps pushing against one bound (persistently sparse gradients: ``N_t <= L`` forever) cannot
wind ``h``/``step`` up to ``inf`` (it used to raise ``OverflowError`` at ``round(inf)`` after ~2047
steps). A step never needs to exceed the whole range, and one element is the smallest step that can
move the integer ``h`` used (an integer variant would use the same minimum magnitude of 1). Every
member of a B-SAG group sees the same ``N_t``, so their controllers stay identical.
"""

from __future__ import annotations

import math

__all__ = ["HController"]

MIN_STEP = 1.0  # elements: smaller steps cannot change round(h) reliably


class HController:
    def __init__(self, P: int, d: int, k: int, L: int | None = None):
        self.P, self.d, self.k = int(P), int(d), int(k)
        self.L = int(L) if L is not None else max(1, (self.d * self.k) // self.P)
        self.h_min = min(self.L, max(1, math.ceil(self.k / self.P)))
        self.max_step = max(MIN_STEP, float(self.L - self.h_min))
        self.h = self.k / self.P
        self.step = 0.01 * self.k * (self.d - 1) / self.P  # Alg. 2 line 1: 1 % of the range L - k/P
        self.flag = False

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
        self._clamp_step()
        self.h = min(float(self.L), max(float(self.h_min), self.h + self.step))

    def _clamp_step(self) -> None:
        """Keep the sign, bound the magnitude to ``[MIN_STEP, max_step]`` (see module docstring)."""
        sign = -1.0 if self.step < 0 else 1.0
        self.step = sign * min(self.max_step, max(MIN_STEP, abs(self.step)))

    def state(self) -> dict:
        return {"h": self.h, "step": self.step, "flag": self.flag}

    def load(self, s: dict) -> None:
        self.h, self.step, self.flag = float(s["h"]), float(s["step"]), bool(s["flag"])
        self._clamp_step()
        self.h = min(float(self.L), max(float(self.h_min), self.h))
