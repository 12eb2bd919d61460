"""``sparcml``: local selection with local error feedback, then a SparCML sparse all-reduce (§7.1).

Per step (Renggli et al., "SparCML: High-Performance Sparse Communication for Machine Learning",
SC 2019; the thesis' Algorithm 2)::

    acc = grad + residual
    (idx, vals) = select(acc)            # topk | bucketed | bucketed_topk | approx | approx_at_most
    residual = acc with idx zeroed       # raw gradient mass, not lr-scaled
    out = sparse_allreduce((idx, vals))  # lossless; algorithm = auto | ssar_rec_dbl | ...

Options: ``selection`` (``"topk"`` exact top-k; ``"bucketed"`` the thesis' bucketed kernel: per bucket of
``bucket_size`` = 512, L1/L-inf sampling for ``kb = max(1, round(density * bucket_size))`` expected
entries, padded with zero-valued pairs or truncated to exactly ``kb`` (``select.approx.bucketed_sample``;
the padding carries no mass, so error feedback keeps ``acc`` there); ``"bucketed_topk"`` the exact
top-``kb`` per bucket instead (deterministic, each bucket's largest entries); ``"approx"`` L1/L-inf
sampling over the whole vector with ``E[#] = k``; ``"approx_at_most"`` the cheaper
``min(1, k|v|/||v||_1)`` variant). ``"bucketed"`` means the thesis' kernel because that is what the
thesis measured (reproduction first); ``"bucketed_topk"`` is the better-quality choice at the price of
a per-bucket sort, and the reducer's default stays ``"topk"``.
``algorithm`` (default ``"auto"``), ``group_size`` (early-switch DSAR), ``seed`` (randomised
selections: rank ``r`` draws from a generator seeded with ``seed * 1_000_003 + r``, saved in the state
for bitwise resume), ``dense_below`` (gradients with fewer elements use a dense all-reduce, as the
thesis' CNTK integration did below 10000; default 0 = always sparse).

Conserving: every selected value is transmitted losslessly, the rest stays in the residual.
Cost: that of the chosen collective for this rank's ``k`` (see :meth:`predicted_cost`).
"""

from __future__ import annotations

import warnings

from ..collectives.auto import AutoState
from ..collectives.registry import COSTS, load_all
from ..select.approx import approx_topk, approx_topk_at_most, bucketed_sample, bucketed_topk, make_generator
from ..select.topk import topk_abs
from ..sparse import SparseVec, as_dense
from .base import Reducer
from .registry import register

SELECTIONS = ("topk", "bucketed", "bucketed_topk", "approx", "approx_at_most")


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
        self.auto_state = AutoState() if algorithm == "auto" else None  # auto's calibration and choices
        self.generator = make_generator(self.seed * 1_000_003 + comm.rank, comm.device)

    def _select(self, acc):
        """``(idx, vals, real)``: the pairs to transmit; ``real`` marks those carrying ``acc`` (None: all)."""
        kb = max(1, round(self.density * self.bucket_size))
        if self.selection == "bucketed":
            return bucketed_sample(acc, kb, self.bucket_size, generator=self.generator)
        if self.selection == "topk":
            idx, vals = topk_abs(acc, self.k, self.scratch)
        elif self.selection == "bucketed_topk":
            idx, vals = bucketed_topk(acc, kb, self.bucket_size)
        elif self.selection == "approx":
            idx, vals = approx_topk(acc, self.k, generator=self.generator)
        else:
            idx, vals = approx_topk_at_most(acc, self.k, generator=self.generator)
        return idx, vals, None

    def _reduce(self, grad):
        if self.numel < self.dense_below:
            self.stats["selected"] = self.numel
            with self.timed("comm"):
                return self.comm.allreduce(grad)
        with self.timed("select"):
            acc = self.memory.add(grad)
            idx, vals, real = self._select(acc)
            vals = self.wire_values(vals)
            if real is None:
                self.memory.keep(acc, idx, vals)
            else:  # bucketed padding carries no mass: acc stays there
                self.memory.keep(acc, idx[real], vals[real])
        self.stats["selected"] = idx.numel()
        opts = {"group_size": self.group_size} if self.algorithm in ("dsar_early_switch", "auto") else {}
        if self.algorithm == "auto" and self.selection in ("topk", "bucketed", "bucketed_topk"):
            # fixed-size selections: every rank sends the same count, known without asking the others
            opts["k"] = idx.numel()
        if self.auto_state is not None:
            opts["state"] = self.auto_state
        info = {}
        with self.timed("comm"):
            out = load_all()[self.algorithm](SparseVec(idx, vals, self.numel, check=False), self.comm,
                                             report=info, **opts)
            out = as_dense(out)
        if "algorithm" in info:
            self.stats["algorithm"] = info["algorithm"]
        return out

    def _extra_state(self) -> dict:
        return {"generator": self.generator.get_state(), "generator_device": self.generator.device.type}

    def _load_extra_state(self, d: dict) -> None:
        """The generator's state only fits a generator of the device type that saved it (CPU
        Mersenne twister, CUDA Philox): a state saved on the other type is not loaded. The exact
        selections (``topk``, ``bucketed_topk``) never draw from it; a randomised one continues with
        this rank's freshly seeded stream, with a warning (its draws cannot resume bitwise there)."""
        if "generator" not in d:
            return
        saved = d.get("generator_device", "cpu")
        if saved == self.generator.device.type:
            self.generator.set_state(d["generator"])
        elif self.selection not in ("topk", "bucketed_topk"):
            warnings.warn(f"sparcml: the {self.selection!r} selection's random stream was saved on {saved} "
                          f"and cannot continue on {self.generator.device.type}; it restarts from its seed "
                          "(not a bitwise resume)", RuntimeWarning, stacklevel=3)

    @classmethod
    def predicted_cost(cls, P, n, k, value_bytes=4, index_bytes=4, algorithm="auto", pattern="random", **_):
        load_all()
        return COSTS[algorithm](P, n, k, value_bytes, index_bytes, pattern=pattern)
