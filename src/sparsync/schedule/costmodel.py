"""Per-message cost model ``t(M) = a + b*M`` with ``M`` in **bytes** of gradient.

Two sources:

* :meth:`CostModel.measure` — time the chosen reducer on the live group over a geometric size sweep
  (one warm-up call, then the median of ``reps`` calls per size, max over ranks so every rank
  holds the same numbers), fit ordinary least squares, broadcast from rank 0, report ``R^2``.
  This is what :class:`sparsync.SparseDDP` does for ``merge="mgwfbp"|"optimal"``.
  For a sparse reducer the fitted ``b`` includes its selection time per gradient byte.
* :meth:`CostModel.from_formula` — the alpha-beta model of the reducer's registry formula
  (``Reducer.predicted_cost``: rounds and bytes received per rank), ``t = rounds*alpha +
  bytes_received/bandwidth``, fitted the same way over a size sweep (used by ``sparsync plan``).
  For the dense ring all-reduce this is exactly ``a = 2(P-1)alpha``, ``b = 2(P-1)/(P*bandwidth)``
  (the paper's Table II ring row with ``gamma = 0``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..units import parse_duration, parse_rate

__all__ = ["CostModel", "default_sizes", "parse_bandwidth", "parse_seconds"]


def parse_bandwidth(s) -> float:
    """Bytes per second: a string by :func:`sparsync.units.parse_rate`'s rule (``"1gbit"`` =
    125e6, ``"125MB/s"``; ``"1gbps"`` is refused as ambiguous); a number is already bytes/s."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        if not s > 0:
            raise ValueError(f"bandwidth must be positive, got {s}")
        return float(s)
    return parse_rate(s) / 8


def parse_seconds(s) -> float:
    """``"50us"``, ``"0.2ms"``, ``"1e-4"`` -> seconds (:func:`sparsync.units.parse_duration`)."""
    return parse_duration(s)


def default_sizes(max_bytes: int, points: int = 8, min_bytes: int = 1024) -> list[int]:
    """Geometric byte sizes from ``min_bytes`` to ``max_bytes`` (multiples of 4)."""
    max_bytes = max(int(max_bytes), min_bytes * 2)
    s = np.geomspace(min_bytes, max_bytes, points)
    return sorted({int(x) // 4 * 4 for x in s})


@dataclass
class CostModel:
    a: float
    b: float
    r2: float | None = None
    source: str = "given"
    sizes: list = field(default_factory=list)
    times: list = field(default_factory=list)

    def predict(self, nbytes) -> float:
        return self.a + self.b * float(nbytes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(**d)

    def __str__(self) -> str:
        r2 = "n/a" if self.r2 is None else f"{self.r2:.4f}"
        return f"t = {self.a * 1e3:.4g} ms + {self.b * 1e9:.4g} ns/byte * M  (R^2 {r2}, {self.source})"

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(cls, sizes, times, source: str = "fit") -> CostModel:
        """Ordinary least squares of ``times`` on ``sizes`` (bytes); ``a`` is clamped at >= 0."""
        x = np.asarray(sizes, dtype=np.float64)
        y = np.asarray(times, dtype=np.float64)
        if x.shape != y.shape or x.size < 2 or len(set(x.tolist())) < 2:
            raise ValueError("a cost-model fit needs at least two distinct sizes")
        b, a = np.polyfit(x, y, 1)
        if a < 0:  # a negative latency is unphysical: refit through the origin
            a, b = 0.0, float((x @ y) / (x @ x))
        pred = a + b * x
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        return cls(float(a), float(max(b, 0.0)), r2, source, [int(v) for v in x], [float(v) for v in y])

    @classmethod
    def from_formula(cls, reducer: str, P: int, alpha: float, bandwidth, density: float = 1.0,
                     value_bytes: int = 4, index_bytes: int = 4, max_bytes: int = 64 << 20, **options) -> CostModel:
        """Fit ``a + b*M`` to the reducer's alpha-beta formula (falls back to the dense ring all-reduce)."""
        from ..reducers.registry import load_all

        bw = parse_bandwidth(bandwidth)
        cls_ = load_all().get(reducer)
        if cls_ is None:
            raise ValueError(f"unknown reducer {reducer!r}; valid: {', '.join(sorted(load_all()))}")
        sizes = default_sizes(max_bytes)
        times, used = [], reducer
        for nb in sizes:
            n = max(1, nb // value_bytes)
            k = min(n, max(1, round(density * n)))
            cost = cls_.predicted_cost(P, n, k, value_bytes=value_bytes, index_bytes=index_bytes, **options)
            if cost is None or cost.get("rounds") is None or cost.get("bytes_received") is None:
                used = f"dense (no formula for {reducer})"
                cost = {"rounds": 2 * (P - 1), "bytes_received": 2 * (P - 1) * n * value_bytes / P if P > 1 else 0}

            def mid(v):
                return (v[0] + v[1]) / 2 if isinstance(v, (tuple, list)) else v

            times.append(mid(cost["rounds"]) * alpha + mid(cost["bytes_received"]) / bw)
        return cls.fit(sizes, times, source=f"formula {used}, P={P}, alpha={alpha:g}s, {bw * 8 / 1e9:g} Gbit/s")

    @classmethod
    def measure(cls, comm, reducer: str, density: float = 0.01, reducer_options: dict | None = None,
                sizes=None, reps: int = 3, max_bytes: int = 64 << 20, dtype=torch.float32) -> CostModel:
        """Time ``reducer`` on the live group over a size sweep; identical result on every rank.

        Collective: every rank must call it with the same arguments. Calls are not recorded in the
        ledger. Uses throw-away reducers, so no training state is touched.
        """
        from ..reducers.registry import make_reducer

        es = torch.empty(0, dtype=dtype).element_size()
        sizes = default_sizes(max_bytes) if sizes is None else [int(s) for s in sizes]
        gen = torch.Generator().manual_seed(1234 + comm.rank)
        med = []
        with comm.unrecorded():
            for nb in sizes:
                n = max(1, nb // es)
                r = make_reducer(reducer, comm, density, **dict(reducer_options or {}))
                x = torch.randn(n, generator=gen, dtype=dtype).to(comm.device)
                r.reduce(x)  # warm-up (and the reducer's one-off set-up collectives)
                ts = []
                for _ in range(reps):
                    comm.barrier()
                    t0 = time.perf_counter()
                    r.reduce(x)
                    ts.append(time.perf_counter() - t0)
                med.append(float(np.median(ts)))
            worst = comm.allreduce(torch.tensor(med, dtype=torch.float64, device=comm.device), "max")
        model = cls.fit([max(1, s // es) * es for s in sizes], worst.cpu().tolist(),
                        source=f"measured {reducer} on {comm.world_size} ranks")
        return model.broadcast(comm)

    def broadcast(self, comm, src: int = 0) -> CostModel:
        """Rank ``src``'s (a, b, r2) on every rank (unrecorded)."""
        if comm.world_size == 1:
            return self
        with comm.unrecorded():
            v = comm.broadcast(torch.tensor([self.a, self.b, -1.0 if self.r2 is None else self.r2],
                                            dtype=torch.float64, device=comm.device), src).cpu().tolist()
        return CostModel(v[0], v[1], None if v[2] == -1.0 else v[2], self.source, self.sizes, self.times)
