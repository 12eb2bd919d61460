"""The shaped links of an emulated cluster, by name, and their rates changed while ranks run.

:class:`Links` addresses the tbf qdiscs of one cluster instance (:mod:`.bandwidth`) from any
process that sees ``/var/run/netns`` - the launcher, or a rank through :func:`links_from_env`.
A rate schedule (``--rate-schedule 50:100mbit,120:1gbit``, :func:`parse_rate_schedule`) is applied
by :func:`change_rate`, a collective: rank 0 changes the rates between two barriers.
"""

from __future__ import annotations

import os
import re
import subprocess

from .bandwidth import format_bandwidth, link_bandwidth, tbf_params
from .system import IFNAME, NETNS_ENV, UPLINK, ClusterUnavailable, run

__all__ = ["Links", "change_rate", "links_from_env", "parse_rate_schedule", "shape"]

_TC_RATE_RE = re.compile(r"\btbf\b.*?\brate (\d+(?:\.\d+)?)([KMG]?)bit", re.S)


def shape(ns: str, dev: str, bits: int, burst_bytes: int | None = None, limit_bytes: int | None = None,
          what: str | None = None) -> None:
    """Limit device ``dev`` of namespace ``ns`` to ``bits`` bits/s (``tc qdisc replace ... tbf``)."""
    burst, limit = tbf_params(bits, burst_bytes, limit_bytes)
    run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
         "burst", str(burst), "limit", str(limit)],
        f"{what or f'limiting {ns}:{dev}'} to {format_bandwidth(bits)} (is sch_tbf available?)")


class Links:
    """The shaped links of one emulated cluster, addressed by name (usable from any process that can
    see ``/var/run/netns``, e.g. a rank: :func:`links_from_env`):

    * ``"inter"``: with sites, every site's uplink (both ends); flat, every host link (the links between hosts);
    * ``"intra"``: every rank's link to its switch (both ends); ``"all"``: both;
    * ``"site<a>"``: site a's uplink; an int ``r``: rank r's link.

    :meth:`set_rate` replaces the tbf qdisc on both ends of each named link (``rate=None``: removes it,
    no limit); packets already queued drain at the old rate, new ones at the new. :meth:`rates` reads
    back what tc reports (``tc qdisc show``), keyed ``"<namespace suffix>:<device>"``.
    """

    def __init__(self, base: str, world_size: int, sites: int = 0, burst_bytes: int | None = None,
                 limit_bytes: int | None = None):
        self.base, self.world_size, self.sites = base, int(world_size), int(sites)
        self.burst_bytes, self.limit_bytes = burst_bytes, limit_bytes

    def env(self) -> str:
        return f"{self.base}:{self.world_size}:{self.sites}"

    def _host_ends(self, r: int) -> list[tuple[str, str]]:
        br = f"b{r // (self.world_size // self.sites)}" if self.sites else "br"
        return [(f"r{r}", IFNAME), (br, f"v{r}")]

    def _uplink_ends(self, a: int) -> list[tuple[str, str]]:
        return [(f"b{a}", UPLINK), ("br", f"s{a}")]

    def ends(self, link="inter") -> list[tuple[str, str]]:
        """``(namespace suffix, device)`` of both ends of every link named ``link`` (class docstring)."""
        hosts = [e for r in range(self.world_size) for e in self._host_ends(r)]
        uplinks = [e for a in range(self.sites) for e in self._uplink_ends(a)]
        if isinstance(link, int) and not isinstance(link, bool):
            if not 0 <= link < self.world_size:
                raise ValueError(f"link: rank {link} is not in [0, {self.world_size})")
            return self._host_ends(link)
        if link == "inter":
            return uplinks if self.sites else hosts
        if link == "intra":
            return hosts
        if link == "all":
            return hosts + uplinks
        m = re.match(r"^site(\d+)$", str(link))
        if m and int(m.group(1)) < self.sites:
            return self._uplink_ends(int(m.group(1)))
        raise ValueError(f"unknown link {link!r}: use 'inter', 'intra', 'all', a rank number, or 'site<a>' "
                         f"(a < {self.sites})" if self.sites else f"unknown link {link!r}: use 'inter', 'intra', "
                         "'all' or a rank number (this cluster has no sites)")

    def set_rate(self, link="inter", rate=None) -> None:
        """Shape every end of ``link`` to ``rate`` (None: unlimited), bounded as ``--bandwidth`` is
        (:func:`~.bandwidth.link_bandwidth`): ValueError before any qdisc changes."""
        bits = link_bandwidth(rate)
        for suffix, dev in self.ends(link):
            ns = self.base + suffix
            if bits is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False,
                               capture_output=True, timeout=30)  # no qdisc there already: nothing to do
                continue
            shape(ns, dev, bits, self.burst_bytes, self.limit_bytes)

    def rates(self, link="all") -> dict[str, int | None]:
        """``{"<ns suffix>:<dev>": bits/s or None}`` as tc reports it now."""
        out = {}
        for suffix, dev in self.ends(link):
            text = run(["tc", "-n", self.base + suffix, "qdisc", "show", "dev", dev], "reading a qdisc")
            m = _TC_RATE_RE.search(text)
            out[f"{suffix}:{dev}"] = (None if m is None else
                                      int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)]))
        return out


def links_from_env(env=None) -> Links | None:
    """The :class:`Links` of the emulated cluster this rank runs on (``SPARSYNC_NETNS``, set by its
    placement), or None outside one."""
    v = (os.environ if env is None else env).get(NETNS_ENV)
    if not v:
        return None
    base, world, sites = v.rsplit(":", 2)
    return Links(base, int(world), int(sites))


def parse_rate_schedule(spec: str | None) -> dict[int, int | None]:
    """``"50:100mbit,120:1gbit"`` -> ``{50: 100_000_000, 120: 1_000_000_000}`` (``none``: no limit);
    every rate read and bounded as ``--bandwidth``'s (:func:`~.bandwidth.link_bandwidth`, one rule for
    both), so a rate no emulated link can hold fails here, before any namespace exists. ValueError in
    one line for anything else."""
    out: dict[int, int | None] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        step, sep, rate = item.partition(":")
        try:
            k = int(step)
        except ValueError:
            k = -1
        if not sep or k < 0:
            raise ValueError(f"--rate-schedule: expected STEP:RATE[,STEP:RATE...] (e.g. 50:100mbit), got {item!r}")
        if k in out:
            raise ValueError(f"--rate-schedule: step {k} is given twice")
        try:
            out[k] = link_bandwidth(rate)
        except ValueError as e:
            raise ValueError(f"--rate-schedule {item.strip()!r}: {e}") from None
    return out


def change_rate(comm, rate, link="inter") -> None:
    """Collective (every rank calls it at the same point): rank 0 sets ``link`` of the emulated cluster
    the ranks run on to ``rate`` (:func:`links_from_env`), between two barriers, so no rank sends
    across the change. Raises ClusterUnavailable outside an emulated cluster."""
    comm.barrier()
    if comm.rank == 0:
        links = links_from_env()
        if links is None:
            raise ClusterUnavailable("a link rate can change only on the emulated cluster (--bandwidth / --topology)")
        links.set_rate(link, rate)
    comm.barrier()
