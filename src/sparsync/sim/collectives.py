"""Collective simulator: alpha-beta predictions for every registered algorithm, and executed
simulation on the thread cluster's virtual clock that validates them.

* **Predicted** time (the alpha-beta cost model ``x*alpha + y*beta``): for every lossless
  collective with a formula in :data:`sparsync.collectives.COSTS` and every reducer whose
  ``predicted_cost`` is not None, ``T = rounds*alpha + beta*bytes_received`` per rank, where a
  formula may give ``(low, high)`` bounds (data-dependent union sizes); for any P (we plot up to 4096).
* **Executed** simulation: the real algorithm code runs on ``run_local(..., backend="thread",
  alpha=, beta=)`` with random index patterns; each ThreadComm rank's virtual clock advances by
  ``alpha + beta*bytes`` per message it sends, a receive waits for the message's arrival, and a
  collective costs its ring-model rounds and bytes (:mod:`sparsync.threadcomm`). The simulated time is
  the maximum clock over ranks when the call returns (P up to 256).

Agreement criterion (tested in ``tests/sim/test_sim_collectives.py`` for every algorithm with a formula;
a formula that raises fails the test): the formulas are per-rank ledgers, so the executed run's
ledger (the maximum over ranks of ``rounds`` and of ``bytes_received``) must **equal** the formula's
value. Only where a formula gives ``(low, high)`` bounds — sizes that depend on the random index
pattern (union sizes after summation, which the formula cannot know) — the ledger must lie within
them. Threshold reducers select a data-dependent number of entries: their formulas take the
per-rank ``counts`` of the step (``predicted_cost(counts=...)``) and are then exact. There is no
per-algorithm allowance: where the code departs from a paper's formula the method's
``predicted_cost`` states the code's formula (and keeps the paper's next to it, e.g.
``table_cost``). The virtual-clock time is reported with the ledger time
``max_r (rounds_r alpha + beta bytes_r)`` beside it; they are equal for algorithms whose every round
moves the same sizes on every rank, and the clock additionally charges size headers and unrecorded
control messages (both visible in the row), which is why the figure shows the clock and the test
compares ledgers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..collectives import COSTS, sparse_allreduce
from ..collectives import load_all as load_collectives
from ..launch import run_local
from ..reducers.registry import load_all as load_reducers
from ..reducers.registry import make_reducer
from ..sparse import SparseVec, index_dtype_for

__all__ = [
    "Algo",
    "algorithms",
    "check_agreement",
    "executed",
    "plot",
    "predicted",
    "predicted_time",
    "sweep",
]

#: default network: 1 Gbit/s (beta = 8 ns/byte), 50 us per message (commodity Ethernet + TCP stack)
ALPHA = 50e-6
BETA = 8e-9


@dataclass(frozen=True)
class Algo:
    name: str
    kind: str  # "collective" (lossless, sparse_allreduce) or "reducer" (lossy, make_reducer)

    @property
    def label(self) -> str:
        return self.name if self.kind == "reducer" else f"{self.name} (lossless)"


def algorithms() -> list[Algo]:
    """Every registered algorithm that has a formula (collectives first, then reducers)."""

    load_collectives()
    out = [Algo(n, "collective") for n in sorted(COSTS)]
    for name, cls in sorted(load_reducers().items()):
        if cls.predicted_cost(4, 4096, 41) is not None:  # a formula that raises is an error, not "none"
            out.append(Algo(name, "reducer"))
    return out


def _k(n: int, density: float) -> int:
    return min(n, max(1, round(density * n)))


def predicted(algo: Algo, P: int, n: int, density: float, counts: list[int] | None = None) -> dict:
    """The formula's ``{"rounds": .., "bytes_received": ..}`` (values may be (low, high)).

    ``counts``: the per-rank selected counts of the step, passed to reducers whose formula takes them
    (threshold selection: the count is data-dependent, the communication given the counts is exact).
    """

    k = _k(n, density)
    ib = torch.empty(0, dtype=index_dtype_for(n)).element_size()
    if algo.kind == "collective":
        load_collectives()
        return COSTS[algo.name](P, n, k, value_bytes=4, index_bytes=ib)
    cls = load_reducers()[algo.name]
    extra = {}
    if counts is not None and "counts" in inspect.signature(cls.predicted_cost).parameters:
        extra["counts"] = counts
    return cls.predicted_cost(P, n, k, value_bytes=4, index_bytes=ib, **extra)


def _bounds(v) -> tuple[float, float]:
    if isinstance(v, (tuple, list)):
        return float(v[0]), float(v[1])
    return float(v), float(v)


def predicted_time(cost: dict, alpha: float, beta: float) -> tuple[float, float]:
    """``(T_lo, T_hi)`` = rounds*alpha + beta*bytes_received, each at its bound."""
    r_lo, r_hi = _bounds(cost["rounds"])
    b_lo, b_hi = _bounds(cost["bytes_received"])
    return r_lo * alpha + beta * b_lo, r_hi * alpha + beta * b_hi


def _balanced_indices(n: int, k: int, P: int, g: torch.Generator) -> torch.Tensor:
    """``k`` sorted random indices, ``k // P'`` (+1 for the first ``k mod P'``) in each of the ``P'`` parts
    of width ``n // P'`` (``P'`` = largest power of two <= P, the last part takes the rest).

    The split-phase formulas charge ``k/P'`` items per part and rank; with indices spread evenly they
    are exact (for ``k`` divisible by ``P'``) instead of an expectation over a multinomial, while
    the union sizes after summation stay random.
    """
    Pp = 1 << (P.bit_length() - 1)
    w = n // Pp
    out = []
    for j in range(Pp):
        size = w if j < Pp - 1 else n - w * (Pp - 1)
        cnt = min(size, k // Pp + (j < k % Pp))
        out.append(j * w + torch.randperm(size, generator=g)[:cnt])
    return torch.cat(out).sort().values


def _exec_rank(comm, algo: Algo, n: int, density: float, seed: int, steps: int):

    g = torch.Generator().manual_seed(seed * 7919 + comm.rank)
    k = _k(n, density)
    if algo.kind == "collective":
        idx = _balanced_indices(n, k, comm.world_size, g)
        sv = SparseVec(idx, torch.randn(k, generator=g), n)
        comm.barrier()
        t0, snap = comm.clock, comm.ledger.snapshot()
        sparse_allreduce(sv, comm, algorithm=algo.name, check=False)
        comm.barrier()
        return comm.clock - t0, comm.ledger.since(snap)
    r = make_reducer(algo.name, comm, density=density)
    times, costs = [], []
    for _ in range(steps):  # later steps show steady-state behaviour (thresholds, controllers)
        grad = torch.randn(n, generator=g)
        comm.barrier()
        t0, snap = comm.clock, comm.ledger.snapshot()
        r.reduce(grad)
        comm.barrier()
        times.append(comm.clock - t0)
        costs.append({**comm.ledger.since(snap), "selected": int(r.stats.get("selected", 0)),
                      "count": int(r.stats.get("local_selected", r.stats.get("selected", 0)))})
    return times[-1], costs[-1]


def executed(algo: Algo, P: int, n: int, density: float, alpha: float = ALPHA, beta: float = BETA,
             seed: int = 0, steps: int = 3, timeout: float = 300.0) -> dict:
    """Run the algorithm on P thread ranks with a virtual clock; time = max clock advance over ranks.

    Ledger values are maxima over ranks; ``counts`` are the per-rank selected counts (reducers) and
    ``ledger_s`` = ``max_r (rounds_r alpha + beta bytes_r)``; ``uniform``: every rank's ledger is the same.
    """

    res = run_local(_exec_rank, P, algo, n, density, seed, steps, backend="thread", alpha=alpha, beta=beta,
                    timeout=timeout)
    t = max(r[0] for r in res)
    led = [r[1] for r in res]
    return {"time_s": t, "rounds": max(c["rounds"] for c in led),
            "bytes_received": max(c["bytes_received"] for c in led),
            "header_messages": max(c["header_messages"] for c in led),
            "selected": max(c.get("selected", 0) for c in led),
            "counts": [c.get("count", 0) for c in led] if algo.kind == "reducer" else None,
            "ledger_s": max(c["rounds"] * alpha + beta * c["bytes_received"] for c in led),
            "uniform": len({(c["rounds"], c["bytes_received"]) for c in led}) == 1}


def _within(x: float, v) -> bool:
    lo, hi = _bounds(v)
    return lo <= x <= hi


def check_agreement(algo: Algo, P: int, n: int, density: float, alpha: float = ALPHA, beta: float = BETA,
                    seed: int = 0) -> dict:
    """Executed ledger vs the formula; ``ok`` per the criterion in the module docstring."""
    ex = executed(algo, P, n, density, alpha, beta, seed)
    cost = predicted(algo, P, n, density, ex["counts"])
    lo, hi = predicted_time(cost, alpha, beta)
    ok_rounds = _within(ex["rounds"], cost["rounds"])
    ok_bytes = _within(ex["bytes_received"], cost["bytes_received"])
    return {"algo": algo.name, "kind": algo.kind, "P": P, "n": n, "density": density, "exec_s": ex["time_s"],
            "pred_lo_s": lo, "pred_hi_s": hi, "ok": ok_rounds and ok_bytes, "ok_rounds": ok_rounds,
            "ok_bytes": ok_bytes, "pred_rounds": cost["rounds"], "pred_bytes": cost["bytes_received"],
            **{f"exec_{k}": v for k, v in ex.items() if k not in ("time_s", "counts")}}


def sweep(n: int = 1 << 16, density: float = 0.01, alpha: float = ALPHA, beta: float = BETA,
          pred_ps=None, exec_ps=None, names=None, progress=print) -> dict:
    """Predicted times for ``pred_ps`` and executed checks for ``exec_ps``, for every algorithm."""
    pred_ps = pred_ps or [2 ** i for i in range(1, 13)]
    exec_ps = exec_ps if exec_ps is not None else [2, 4, 8, 16, 32, 64, 128, 256]
    algos = [a for a in algorithms() if names is None or a.name in names]
    out = {"n": n, "density": density, "alpha": alpha, "beta": beta, "predicted": [], "executed": []}
    for a in algos:
        for P in pred_ps:  # a formula that raises is an error (no silent gaps in the figure)
            lo, hi = predicted_time(predicted(a, P, n, density), alpha, beta)
            out["predicted"].append({"algo": a.name, "kind": a.kind, "P": P, "lo_s": lo, "hi_s": hi})
        blowup = False
        for P in exec_ps:
            if blowup and P > 32:  # thread ranks hold P copies of P near-dense messages: O(P^2 n) memory
                progress(f"  {a.label} P={P}: skipped (near-dense selection at smaller P: O(P^2 n) memory)")
                continue
            try:
                row = check_agreement(a, P, n, density, alpha, beta)
                # near-dense messages through all-gathers (thresholds far too low in the first steps)
                blowup = blowup or (a.name != "dense" and row.get("exec_selected", 0) > n // 4)
            except (MemoryError, RuntimeError, TimeoutError) as e:  # e.g. O(P^2 n) memory at large P: report
                progress(f"  {a.label} P={P}: executed simulation failed ({type(e).__name__}: {str(e)[:160]})")
                out.setdefault("failed", []).append({"algo": a.name, "kind": a.kind, "P": P, "error": type(e).__name__})
                continue
            out["executed"].append(row)
            progress(f"  {a.label:32s} P={P:4d}  exec {1e3 * row['exec_s']:9.3f} ms  formula "
                     f"[{1e3 * row['pred_lo_s']:9.3f}, {1e3 * row['pred_hi_s']:9.3f}] ms  "
                     f"ledger {'= formula' if row['ok'] else 'DIFFERS from formula'}")
    return out


def plot(result: dict, path) -> None:
    """Time vs P (log-log): formula lines (band for bounds), executed points."""
    from ..extras import require

    require("matplotlib", "plots", "the simulator plot").use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({(r["algo"], r["kind"]) for r in result["predicted"]})
    fig, axes = plt.subplots(1, 2, figsize=(14, 6), sharey=True)
    cmap = plt.get_cmap("tab10")
    for ax, kind, title in ((axes[0], "collective", "lossless sparse all-reduce (sparse_allreduce)"),
                            (axes[1], "reducer", "reducers (make_reducer; dots after 3 steps)")):
        mine = [nk for nk in names if nk[1] == kind]
        for i, (name, _) in enumerate(mine):
            c = cmap(i % 10)
            ls = "-" if i < 10 else "--"
            rows = sorted((r for r in result["predicted"] if r["algo"] == name and r["kind"] == kind),
                          key=lambda r: r["P"])
            ps = [r["P"] for r in rows]
            ax.plot(ps, [r["hi_s"] for r in rows], ls, color=c, label=name, lw=1.3)
            if any(r["lo_s"] != r["hi_s"] for r in rows):
                ax.fill_between(ps, [r["lo_s"] for r in rows], [r["hi_s"] for r in rows], color=c, alpha=0.12)
            ex = sorted((r for r in result["executed"] if r["algo"] == name and r["kind"] == kind),
                        key=lambda r: r["P"])
            if ex:
                ax.scatter([r["P"] for r in ex], [r["exec_s"] for r in ex], color=c, marker="o" if i < 10 else "s",
                           s=16)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers P")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
    axes[0].set_ylabel("time per call (s)")
    fig.suptitle(f"alpha-beta formulas (lines = upper bound, bands = bounds) vs executed thread simulation (dots); "
                 f"n = {result['n']}, density {result['density']}, alpha = {1e6 * result['alpha']:.0f} us, "
                 f"beta = {result['beta'] * 1e9:.0f} ns/byte", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

