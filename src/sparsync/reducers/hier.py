"""Hierarchical exchange: dense inside a site, any sparsync reducer between sites.

When ranks sit in *sites* (machines, racks, datacenters: fast links inside, one slower uplink per
site shared by all its ranks; :mod:`sparsync.sites`), a flat exchange sends every rank's bytes
across the uplink. The two-level scheme of hierarchical all-reduce (Horovod's
``HOROVOD_HIERARCHICAL_ALLREDUCE``; Mikami et al., "Massively Distributed SGD", 2018; the 2D-torus
all-reduce of Ying et al., 2018) moves only ``1/s`` of it there, and the sparsification is applied
where the link is slow:

1. **reduce-scatter inside the site** (dense, lossless): the gradient (padded to ``s * m``,
   ``m = ceil(n / s)``, ``s`` ranks per site) is cut into ``s`` shards; the rank at position ``j`` of
   its site receives shard ``j`` from every site peer (direct sends) and sums the ``s`` copies in
   site-rank order: the site's sum of shard ``j``;
2. **across sites, per shard**: the ranks at position ``j`` of every site form one group (``S``
   ranks, one per site); an *outer* reducer of any registered kind (``outer="micro"``, its density
   and options) reduces the site sums over that group, with its own error feedback: **the residual
   lives at this level**, on the shard (what the outer reducer did not send of the site's sum).
   One outer reducer per shard position; each returns the same bits on every rank of its group;
3. **all-gather inside the site**: the ``s`` reduced shards are assembled on every rank. Every rank
   at position ``j`` holds the same outer result, so the output is bitwise identical everywhere.

Conservation: the inner level is lossless, so ``sum_r(grad_r + residual_before_r) == out +
sum_r(residual_after_r)`` holds exactly when the outer reducer conserves (up to the summation order
of the site sums); :attr:`HierReducer.residual` is this rank's outer residual placed at its shard
(zeros elsewhere) plus anything assigned to it (a residual set from outside, e.g. when SparseDDP
regroups, is added to the next gradient: nothing is dropped).

Cost per rank (``stats``: the ledger split by level, ``intra_*`` and ``inter_*``; the totals
``bytes_sent`` etc. hold both): inside the site ``(s-1) m`` values sent in the reduce-scatter and
``(s-1) m`` in the ring all-gather, i.e. ``2 (s-1) m * 4`` bytes each way for fp32, ``2(s-1)`` rounds
(``2(s-1)/s * n * 4`` when ``s`` divides ``n``); across sites the outer reducer's own cost formula
for ``S`` ranks and ``m`` elements (:meth:`HierReducer.predicted_cost`).

Sites come from ``sites=`` (a layout ``[[0, 1], [2, 3]]`` or ``"2x2"``), else the environment
(:func:`sparsync.site_layout`: the emulated cluster's topology, torchrun's nodes), resolved at the
first call; where nothing says, every rank is its own site (``s = 1``: the outer reducer, flat).
``stats["sites"]`` names the layout used (``"SxR"``). Uneven sites are refused. Sub-groups come from
:meth:`sparsync.comm.Comm.split` (on gloo every rank creates every group, at the first call, in the
same order on all ranks).
"""

from __future__ import annotations

import torch

from ..sites import check_layout, site_layout
from .base import VALUE_DTYPES, Reducer
from .capabilities import OptionFact
from .memory import cpu_copy, placed
from .registry import REDUCERS, make_reducer, register

__all__ = ["HierReducer"]

INNER = ("dense",)
_OWN = ("inner", "outer", "sites", "value_dtype", "nonfinite")


def _outer_conserves(outer: str, value_dtype: str) -> bool:
    cls = REDUCERS.lookup(outer)
    return bool(cls.conserving) and (VALUE_DTYPES[value_dtype] is None or bool(cls.value_dtype_conserving))


@register("hier")
class HierReducer(Reducer):
    """``make_reducer("hier", comm, density, inner="dense", outer="micro", sites=None, **outer_options)``.

    ``density`` and ``value_dtype`` are the outer reducer's (the fraction of each shard sent between
    sites); any other keyword is an option of the outer reducer. ``conserving`` is the outer's.
    """

    supports_value_dtype = True  # handed to the outer reducer, which refuses it if it cannot
    #: the outer reducer class's fact for this ``value_dtype`` (the inner level is lossless)
    conserving = OptionFact(True, lambda r: _outer_conserves(r.outer_name, r.outer_options["value_dtype"]))

    def __init__(self, comm, density: float = 0.01, inner: str = "dense", outer: str = "micro", sites=None,
                 value_dtype: str = "fp32", nonfinite: str = "error", **outer_options):
        if inner not in INNER:
            raise ValueError(f"hier: inner must be one of {', '.join(INNER)} (a lossless reduce-scatter), "
                             f"got {inner!r}")
        if outer == "hier":
            raise ValueError("hier: outer cannot be 'hier' itself")
        outer_cls = REDUCERS.lookup(outer)
        outer_cls.check_options({"value_dtype": value_dtype, **outer_options})
        super().__init__(comm, density=density, nonfinite=nonfinite)
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {', '.join(VALUE_DTYPES)}, got {value_dtype!r}")
        if VALUE_DTYPES[value_dtype] is not None and not outer_cls.supports_value_dtype:
            raise ValueError(f"hier: outer reducer {outer!r} does not support value_dtype={value_dtype!r}")
        self.inner, self.outer_name = inner, outer
        self.outer_options = {"value_dtype": value_dtype, **outer_options}
        self.sites = None if sites is None else site_layout(comm.world_size, sites)
        self.layout: list[list[int]] | None = None
        self._outer: Reducer | None = None
        self._site = self._cross = None
        self._stash = None  # outer state loaded before the outer reducer exists

    # ------------------------------------------------------------------ options
    @classmethod
    def option_names(cls) -> list[str]:
        return sorted(_OWN)

    @classmethod
    def check_options(cls, options: dict, _unknown=None) -> None:
        """Own options, the rest checked as options of the outer reducer."""
        outer = options.get("outer", "micro")
        rest = {k: v for k, v in options.items() if k not in _OWN or k == "value_dtype"}
        try:
            REDUCERS.lookup(outer).check_options(rest)
        except TypeError as e:
            raise TypeError(f"reducer 'hier': {e} (hier's own: {', '.join(sorted(_OWN))})") from None

    # ------------------------------------------------------------------ residual (outer level)
    @property
    def residual(self) -> torch.Tensor | None:
        """The outer residual at this rank's shard (zeros elsewhere) plus what this reducer's own memory
        holds: a residual assigned from outside, added to the next gradient."""
        res = None if self._outer is None else self._outer.residual
        if res is None:
            return self.memory.residual
        lo, hi = self._shard_range()
        return placed(res[: hi - lo], lo, self.numel, self.memory.residual)

    @residual.setter
    def residual(self, value) -> None:
        self.memory.residual = value
        if self._outer is not None:
            self._outer.residual = None

    def _shard_range(self) -> tuple[int, int]:
        m, j = self._m, self._site.rank
        return min(j * m, self.numel), min((j + 1) * m, self.numel)

    # ------------------------------------------------------------------ set-up (first call)
    def _setup(self, n: int) -> None:
        P = self.comm.world_size
        layout = self.sites if self.sites is not None else site_layout(P)
        if layout is None:  # nothing says: every rank its own site (the outer reducer, flat)
            layout = [[r] for r in range(P)]
        self.layout = check_layout(layout, P)
        s = len(self.layout[0])
        self._site = self.comm.split(self.layout)
        self._cross = self.comm.split([[site[j] for site in self.layout] for j in range(s)])
        self._m = -(-n // s)
        # the outer reducer checks what it accumulates (shard + its residual) under this reducer's policy
        self._outer = make_reducer(self.outer_name, self._cross, self.density, nonfinite=self.nonfinite,
                                   **self.outer_options)
        if self._stash is not None:
            self._outer.load_state_dict(self._stash)
            self._stash = None

    # ------------------------------------------------------------------ the exchange
    def _reduce(self, grad: torch.Tensor) -> torch.Tensor:
        n = grad.numel()
        if self._site is None:
            self._setup(n)
        site, s, m = self._site, self._site.world_size, self._m
        acc = self.memory.drain(grad)  # a residual assigned from outside: added once, then the outer's memory has it
        if s * m != n:
            x = acc.new_zeros(s * m)
            x[:n] = acc
        else:
            x = acc
        s_snap, c_snap = site.ledger.snapshot(), self._cross.ledger.snapshot()
        with self.timed("comm"):
            with site.phase("intra:reduce-scatter"):
                shard = self._reduce_scatter(x, m)
        try:
            y = self._outer.reduce(shard)
        except FloatingPointError as e:  # named as this reducer's, with this rank's number
            where = f"rank {self._cross.rank}: {self._outer.name}.reduce"
            msg = str(e)
            raise FloatingPointError(f"rank {self.comm.rank}: {self.name}.reduce" + msg[len(where):]
                                     if msg.startswith(where) else msg) from None
        out = self.output_buffer(s * m, y.dtype, y.device)
        with self.timed("comm"):
            with site.phase("intra:all-gather"):
                site.allgather_into(y, out)
        intra, inter = site.ledger.since(s_snap), self._cross.ledger.since(c_snap)
        o = self._outer.stats
        self.stats.update(
            selected=o.get("selected", m), outer_density=o.get("density"), inner=self.inner, outer=self.outer_name,
            sites=f"{len(self.layout)}x{s}",
            intra_bytes=intra["bytes_sent"], intra_bytes_received=intra["bytes_received"],
            intra_rounds=intra["rounds"], inter_bytes=inter["bytes_sent"],
            inter_bytes_received=inter["bytes_received"], inter_rounds=inter["rounds"],
            select_s=self.stats.get("select_s", 0.0) + o.get("select_s", 0.0),
            comm_s=self.stats.get("comm_s", 0.0) + o.get("comm_s", 0.0))
        return out[:n]

    def _reduce_scatter(self, x: torch.Tensor, m: int) -> torch.Tensor:
        """This position's shard summed over the site: direct sends of the other shards to their
        owners (``s-1`` messages of ``m`` values each way), then the sum in site-rank order."""
        site = self._site
        s, j = site.world_size, site.rank
        mine = x[j * m:(j + 1) * m]
        if s == 1:
            return mine
        peers = [i for i in range(s) if i != j]
        handles = site.post([(i, x[i * m:(i + 1) * m]) for i in peers], [(i, m, x.dtype) for i in peers])
        parts = {i: h.wait() for i, h in zip(peers, handles)}
        parts[j] = mine
        total = torch.add(parts[0], parts[1])  # one pass writes the first sum (no copy of parts[0])
        for i in range(2, s):
            total += parts[i]
        return total

    # ------------------------------------------------------------------ state
    def _extra_state(self) -> dict:
        outer = self._outer
        return {"layout": self.layout, "outer": outer.state_dict() if outer is not None else self._stash,
                "pending": cpu_copy(self.memory.residual)}

    def _load_extra_state(self, d: dict) -> None:
        pending = d.get("pending")  # replaces what load_state_dict's residual assignment put there
        self.memory.residual = None if pending is None else pending.to(self.comm.device).clone()
        if d.get("layout") is not None and self.layout is not None and d["layout"] != self.layout:
            raise ValueError(f"hier state was saved with sites {d['layout']}, this reducer has {self.layout}")
        state = d.get("outer")
        outer = self._outer
        if outer is not None and state is not None:
            outer.load_state_dict(state)
        else:
            self._stash = state

    @classmethod
    def predicted_cost(cls, P, n, k=None, value_bytes=4, index_bytes=4, sites=None, outer="micro", **options):
        """Per rank: the totals ``{"rounds", "bytes_received"}`` and the same by level, ``"intra"`` and
        ``"inter"`` (module docstring); ``sites`` a layout or ``"SxR"`` (None: one rank per site). The
        inter level is the outer reducer's formula on ``S`` ranks and ``m`` elements with ``k`` scaled
        to the shard (``density=`` instead gives it exactly); None where the outer reducer has none."""
        layout = site_layout(P, sites, env={}) or [[r] for r in range(P)]
        S, s = len(layout), len(layout[0])
        m = -(-n // s)
        density = options.pop("density", None)
        km = max(1, int(round(density * m))) if density is not None else max(1, -(-(k or n) // s))
        intra = {"rounds": 2 * (s - 1), "bytes_received": 2 * (s - 1) * m * value_bytes,
                 "bytes_sent": 2 * (s - 1) * m * value_bytes}
        inter = REDUCERS.lookup(outer).predicted_cost(S, m, km, value_bytes=value_bytes, index_bytes=index_bytes,
                                                      **options)
        if inter is None:
            return None

        def add(a, b):
            if isinstance(a, tuple) or isinstance(b, tuple):
                a, b = (a if isinstance(a, tuple) else (a, a)), (b if isinstance(b, tuple) else (b, b))
                return (a[0] + b[0], a[1] + b[1])
            return a + b

        return {"rounds": add(intra["rounds"], inter["rounds"]),
                "bytes_received": add(intra["bytes_received"], inter["bytes_received"]),
                "intra": intra, "inter": inter}
