"""Sites: which ranks share a fast local network, and the network spec of a multi-site cluster.

A *site* is a set of ranks behind one switch (a machine, a rack, a datacenter): links inside it are
fast; between sites one slower link per site (its uplink) carries the traffic of every rank of the
site. Hierarchical exchanges (:mod:`sparsync.reducers.hier`) reduce densely inside a site and send
only one shard per rank across sites, so the uplink carries ``1/s`` of a flat exchange's bytes
(the two-level schemes of Horovod's hierarchical all-reduce and of 2D-torus all-reduce; Mikami et
al., "Massively Distributed SGD", 2018).

A layout is a list of rank lists, ``[[0, 1], [2, 3]]``: a partition of ``range(world_size)`` into
sites of equal size (uneven sites are refused: every shard position needs a peer in every site).
:func:`site_layout` finds it, first match wins:

1. an explicit ``sites=`` argument: a layout, or ``"SxR"`` (S sites of R consecutive ranks);
2. ``SPARSYNC_SITES`` in the environment (``"0,1;2,3"``), which the emulated cluster's placement sets
   in every rank (:class:`sparsync.cluster.EmulatedCluster` with a topology);
3. torchrun's node layout: ``LOCAL_WORLD_SIZE`` ranks per node, node ``GROUP_RANK`` holding ranks
   ``GROUP_RANK * LOCAL_WORLD_SIZE + local_rank`` (torchrun numbers ranks node by node; every node
   must run the same number of ranks);
4. none: ``None`` (the caller decides; the hierarchical reducer refuses in one line).

Network spec of the emulated cluster (``sparsync train --topology 2x2 --intra 10gbit --inter
200mbit``): :class:`Topology`, written ``"2x2@10gbit/200mbit"`` wherever a network is named by one
string (run configs, benchmark tables).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .units import format_rate, link_bandwidth

__all__ = ["SITES_ENV", "Topology", "check_layout", "format_layout", "parse_layout", "site_layout",
           "is_topology_spec"]

SITES_ENV = "SPARSYNC_SITES"
_GRID_RE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")
_SPEC_RE = re.compile(r"^\s*(\d+\s*x\s*\d+)\s*@\s*([^/]+)/(.+)$")


def check_layout(sites, world_size: int | None = None) -> list[list[int]]:
    """``sites`` as a list of sorted int lists, or ValueError (one line) when it is not a partition of
    ``range(world_size)`` into equal, non-empty sites (``world_size=None``: of ``range(total)``)."""
    try:
        layout = [sorted(int(r) for r in site) for site in sites]
    except (TypeError, ValueError):
        raise ValueError(f"sites must be a list of rank lists, e.g. [[0, 1], [2, 3]], got {sites!r}") from None
    if not layout or any(not s for s in layout):
        raise ValueError(f"sites must be non-empty lists of ranks, got {sites!r}")
    flat = sorted(r for s in layout for r in s)
    P = len(flat) if world_size is None else int(world_size)
    if flat != list(range(P)):
        raise ValueError(f"sites {format_layout(layout)} must hold every rank 0..{P - 1} exactly once")
    sizes = sorted({len(s) for s in layout})
    if len(sizes) > 1:
        raise ValueError(f"sites {format_layout(layout)} have uneven sizes {sizes}: every site needs the same "
                         "number of ranks (one shard per rank position in every site)")
    return sorted(layout)


def _grid(spec: str) -> tuple[int, int] | None:
    m = _GRID_RE.match(spec)
    if not m:
        return None
    S, R = int(m.group(1)), int(m.group(2))
    if S < 1 or R < 1:
        raise ValueError(f"topology {spec!r}: sites and ranks per site must be >= 1")
    return S, R


def parse_layout(spec, world_size: int | None = None) -> list[list[int]]:
    """A layout from ``"SxR"`` (S sites of R consecutive ranks), ``"0,1;2,3"``, or a list of lists."""
    if isinstance(spec, str):
        g = _grid(spec)
        if g is not None:
            S, R = g
            layout = [list(range(a * R, (a + 1) * R)) for a in range(S)]
        else:
            try:
                layout = [[int(r) for r in site.split(",") if r.strip()] for site in spec.split(";") if site.strip()]
            except ValueError:
                raise ValueError(f"sites {spec!r}: expected 'SxR' (e.g. 2x2) or 'r,r;r,r' (e.g. 0,1;2,3)") from None
        return check_layout(layout, world_size)
    return check_layout(spec, world_size)


def format_layout(layout) -> str:
    """``[[0, 1], [2, 3]]`` -> ``"0,1;2,3"`` (the ``SPARSYNC_SITES`` spelling)."""
    return ";".join(",".join(str(r) for r in s) for s in layout)


def site_layout(world_size: int, sites=None, env=None) -> list[list[int]] | None:
    """The site layout of a world of ``world_size`` ranks (module docstring: explicit ``sites``, then
    ``SPARSYNC_SITES``, then torchrun's ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK``), or None when nothing
    says. ValueError (one line) for a layout that is not a partition into equal sites."""
    if sites is not None:
        return parse_layout(sites, world_size)
    env = os.environ if env is None else env
    if env.get(SITES_ENV):
        return parse_layout(env[SITES_ENV], world_size)
    local = env.get("LOCAL_WORLD_SIZE")
    if local and "GROUP_RANK" in env:
        L = int(local)
        if L < 1 or world_size % L:
            raise ValueError(f"torchrun layout: WORLD_SIZE {world_size} is not a multiple of LOCAL_WORLD_SIZE {L} "
                             "(nodes run different numbers of ranks); pass sites= explicitly")
        return [list(range(g * L, (g + 1) * L)) for g in range(world_size // L)]
    return None


def is_topology_spec(network) -> bool:
    return isinstance(network, str) and _SPEC_RE.match(network) is not None


@dataclass(frozen=True)
class Topology:
    """``sites`` x ``ranks_per_site`` ranks; ``intra``: each rank's link to its site's switch,
    ``inter``: each site's uplink to the inter-site switch (tc rates, bits/s; None = no limit)."""

    sites: int
    ranks_per_site: int
    intra: int | None
    inter: int | None

    @classmethod
    def parse(cls, grid: str, intra, inter) -> Topology:
        """From the CLI's ``--topology 2x2 --intra 10gbit --inter 200mbit``; ValueError in one line."""
        g = _grid(str(grid))
        if g is None:
            raise ValueError(f"--topology must look like SITESxRANKS (e.g. 2x2), got {grid!r}")
        if intra is None or inter is None:
            raise ValueError("--topology needs both --intra RATE (inside a site) and --inter RATE (between sites)")
        return cls(g[0], g[1], link_bandwidth(intra), link_bandwidth(inter))  # rates an emulated link can hold

    @classmethod
    def from_spec(cls, spec: str) -> Topology:
        """From ``"2x2@10gbit/200mbit"`` (:meth:`spec`)."""
        m = _SPEC_RE.match(spec)
        if not m:
            raise ValueError(f"not a topology spec (SITESxRANKS@INTRA/INTER, e.g. 2x2@10gbit/200mbit): {spec!r}")
        return cls.parse(m.group(1), m.group(2).strip(), m.group(3).strip())

    @property
    def world_size(self) -> int:
        return self.sites * self.ranks_per_site

    @property
    def layout(self) -> list[list[int]]:
        R = self.ranks_per_site
        return [list(range(a * R, (a + 1) * R)) for a in range(self.sites)]

    def site_of(self, rank: int) -> int:
        return rank // self.ranks_per_site

    def spec(self) -> str:
        bw = (lambda b: "none" if b is None else format_rate(b))
        return f"{self.sites}x{self.ranks_per_site}@{bw(self.intra)}/{bw(self.inter)}"
