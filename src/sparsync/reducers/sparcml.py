"""``sparcml``: local selection with local error feedback, then a SparCML sparse all-reduce (§7.1).

Per step (thesis Algorithm 2, ``spec/sparcml.md`` §7.1)::

    acc = grad + residual
    (idx, vals) = select(acc)            # topk | bucketed | approx | approx_at_most
    residual = acc with idx zeroed       # raw gradient mass, not lr-scaled
    out = sparse_allreduce((idx, vals))  # lossless; algorithm = auto | ssar_rec_dbl | ...

Options: ``selection`` (``"topk"`` exact top-k, ``"bucketed"`` top-``kb`` per bucket of
``bucket_size`` = 512 with ``kb = max(1, round(density * bucket_size))``, ``"approx"`` L1/L-inf
sampling with ``E[#] = k``, ``"approx_at_most"`` the cheaper ``min(1, k|v|/||v||_1)`` variant),
``algorithm`` (default ``"auto"``), ``group_size`` (early-switch DSAR), ``seed`` (randomised
selections: rank ``r`` draws from a generator seeded with ``seed * 1_000_003 + r``, saved in the state
for bitwise resume), ``dense_below`` (gradients with fewer elements use a dense all-reduce, as the
thesis' CNTK integration did below 10000; default 0 = always sparse).

Conserving: every selected value is transmitted losslessly, the rest stays in the residual.
Cost: that of the chosen collective for this rank's ``k`` (see :meth:`predicted_cost`).
"""

from __future__ import annotations

from ..collectives.registry import COSTS, load_all
from ..select.approx import approx_topk, approx_topk_at_most, bucketed_topk, make_generator
from ..select.topk import topk_abs
from ..sparse import SparseVec, as_dense
from .base import Reducer
from .registry import register

SELECTIONS = ("topk", "bucketed", "approx", "approx_at_most")


@register("sparcml")
class SparCMLReducer(Reducer):
    supports_value_dtype = True  # half values on the wire (first stage), every sum in fp32
    def __init__(self, comm, density: float = 0.01, selection: str = "topk", algorithm: str = "auto",
                 bucket_size: int = 512, group_size: int = 8, seed: int = 0, dense_below: int = 0, **rest):
        super().__init__(comm, density=density, **rest)
        if selection not in SELECTIONS:
            raise ValueError(f"sparcml: unknown selection {selection!r}; valid: {', '.join(SELECTIONS)}")
        algos = load_all()
        if algorithm not in algos:
            raise ValueError(f"sparcml: unknown algorithm {algorithm!r}; valid: {', '.join(sorted(algos))}")
        if int(bucket_size) < 1:
            raise ValueError(f"sparcml: bucket_size must be >= 1, got {bucket_size}")
        self.selection = selection
        self.algorithm = algorithm
        self.bucket_size = int(bucket_size)
        self.group_size = int(group_size)
        self.seed = int(seed)
        self.dense_below = int(dense_below)
        self.generator = make_generator(self.seed * 1_000_003 + comm.rank, comm.device)

    def _select(self, acc):
        if self.selection == "topk":
            return topk_abs(acc, self.k)
        if self.selection == "bucketed":
            kb = max(1, round(self.density * self.bucket_size))
            return bucketed_topk(acc, kb, self.bucket_size)
        if self.selection == "approx":
            return approx_topk(acc, self.k, generator=self.generator)
        return approx_topk_at_most(acc, self.k, generator=self.generator)

    def _reduce(self, grad):
        if self.numel < self.dense_below:
            self.stats["selected"] = self.numel
            with self.timed("comm"):
                return self.comm.allreduce(grad)
        with self.timed("select"):
            acc = self.accumulate(grad)
            idx, vals = self._select(acc)
            vals = self.wire_values(vals)
            self.keep_unsent(acc, idx, vals)
        self.stats["selected"] = idx.numel()
        opts = {"group_size": self.group_size} if self.algorithm in ("dsar_early_switch", "auto") else {}
        if self.algorithm == "auto" and self.selection in ("topk", "bucketed"):
            # fixed-size selections: every rank sends the same count, known without asking the others
            opts["k"] = idx.numel()
        info = {}
        with self.timed("comm"):
            out = load_all()[self.algorithm](SparseVec(idx, vals, self.numel, check=False), self.comm,
                                             report=info, **opts)
            out = as_dense(out)
        if "algorithm" in info:
            self.stats["algorithm"] = info["algorithm"]
        return out

    def _extra_state(self) -> dict:
        return {"generator": self.generator.get_state()}

    def _load_extra_state(self, d: dict) -> None:
        if "generator" in d:
            self.generator.set_state(d["generator"])

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, algorithm="auto", pattern="random", **_):
        load_all()
        return COSTS[algorithm](P, n, k, value_bytes, index_bytes, pattern=pattern)
