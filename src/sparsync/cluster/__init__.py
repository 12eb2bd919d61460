"""Emulated cluster: P ranks on one machine, each behind its own bandwidth-limited network link.

Why: on loopback sparse methods rarely beat a dense all-reduce - the links are far faster than the
networks sparsification is for; their gains show on slow links. This package builds such links with
Linux network namespaces, so that real gloo processes talk over real TCP through a rate limiter.

Use::

    with EmulatedCluster(4, bandwidth="1gbit") as cl:      # or topology="2x2@10gbit/200mbit"
        out = run_local(fn, 4, backend="gloo", placement=cl.placement)

``cl.placement(rank)`` runs in the forked rank process before its gloo group starts: it enters the
rank's namespace with ``setns(fd, CLONE_NEWNET)`` (the process is single-threaded right after fork,
and threads gloo creates later inherit the namespace) and returns ``{"GLOO_SOCKET_IFNAME": "eth0"}``
(with a topology also the sites layout). Rendezvous is a FileStore, which works across namespaces.
:func:`open_network` names a network by a string (``"loopback"``, a rate, a topology spec);
:func:`run_emulated` is ``run_local`` on a fresh cluster.

The parts, one job each:

* :mod:`.wiring` - the namespaces, bridges and veth pairs of an instance and their addresses (a
  private /24 each, no route out);
* :mod:`.bandwidth`, :mod:`.links` - rates and the tbf qdiscs that enforce them, on both ends of every
  link; :class:`Links` changes them while ranks run (:func:`change_rate`, :func:`parse_rate_schedule`);
* :mod:`.guard` - cleanup always happens: ``__exit__``, an ``atexit`` hook, and SIGINT/SIGTERM
  handlers (installed while a network is open) that clean up and then chain to the previous handler.
  Deleting the namespaces deletes their veths and bridges. When the process is killed (SIGKILL) -
  while the cluster is being built, or while ranks run on it - the cluster's own reaper process
  (:func:`sparsync.launch.start_reaper`), forked before the first namespace is made, deletes every
  namespace of this process; the ranks die with their parent;
* :mod:`.stale` - ``sparsync cluster cleanup`` (:func:`cleanup_stale`) removes whatever is still left
  by dead owners: namespaces, rank processes, rendezvous directories;
* :mod:`.system` - names, the privilege check, the ``ip``/``tc`` calls, ``setns``, the subnet lock
  (``/run/sparsync/cluster.lock``, root-only directory, opened with ``O_NOFOLLOW``);
* :mod:`.loopback` - the null network with the same interface.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``); without them
:class:`EmulatedCluster` raises :class:`ClusterUnavailable` saying what is missing, or falls back to
loopback with a warning when asked to. netem is not used, so no latency is added (propagation ~ 0).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..sites import SITES_ENV, format_layout, is_topology_spec
from .bandwidth import MAX_BANDWIDTH, format_bandwidth, link_bandwidth, parse_bandwidth, tbf_params
from .guard import GUARD, CleanupGuard
from .links import Links, change_rate, links_from_env, parse_rate_schedule
from .loopback import Loopback
from .stale import cleanup_stale, namespaces_of, stale_rank_processes, stale_stores
from .system import (BRIDGE, IFNAME, NETNS_DIR, NETNS_ENV, PREFIX, SUBNET_BASE, UPLINK, ClusterUnavailable,
                     delete_namespaces, list_namespaces, netns_unavailable_reason, run, setns)
from .wiring import MAX_RANKS, claim, wire

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    # the network
    "ClusterUnavailable", "EmulatedCluster", "Loopback", "network_label", "open_network", "run_emulated",
    # rates and links
    "MAX_BANDWIDTH", "Links", "change_rate", "format_bandwidth", "link_bandwidth", "links_from_env",
    "parse_bandwidth", "parse_rate_schedule", "tbf_params",
    # names, system, cleanup
    "BRIDGE", "IFNAME", "NETNS_ENV", "PREFIX", "SUBNET_BASE", "UPLINK", "CleanupGuard", "cleanup_stale",
    "list_namespaces", "netns_unavailable_reason", "stale_rank_processes", "stale_stores",
]

# private names of this module before it was split into parts, kept for the tools that use them
_delete_namespaces = delete_namespaces
_on_signal = GUARD.on_signal  # the SIGINT/SIGTERM handler while a network is open

_HOW_TO = ("Run it as root (e.g. `sudo .venv/bin/sparsync ...`), or run on loopback without a "
           "bandwidth limit instead: EmulatedCluster(..., fallback_loopback=True) / "
           "run_emulated(..., fallback_loopback=True) / `--bandwidth loopback` on the CLI.")


def _as_topology(topology, world_size: int, bandwidth):
    """``topology`` (a :class:`~sparsync.sites.Topology` or its spec string) checked against the world
    size, or None; a bandwidth beside a topology is refused (``intra`` / ``inter`` say the rates)."""
    if topology is None:
        return None
    from ..sites import Topology

    topo = Topology.from_spec(topology) if isinstance(topology, str) else topology
    if not isinstance(topo, Topology):
        raise ValueError(f"topology must be a sparsync.sites.Topology or a spec like '2x2@10gbit/200mbit', "
                         f"got {topology!r}")
    if topo.world_size != world_size:
        raise ValueError(f"topology {topo.spec()} has {topo.world_size} ranks, not world_size={world_size}")
    if bandwidth is not None:
        raise ValueError("give either bandwidth (flat) or topology (its intra and inter rates), not both")
    return topo


# ---------------------------------------------------------------------- the cluster
class EmulatedCluster:
    """``world_size`` network namespaces behind a bridge, links optionally rate-limited with tbf.

    >>> with EmulatedCluster(4, bandwidth="1gbit") as cl:          # doctest: +SKIP
    ...     out = ss.run_local(fn, 4, backend="gloo", placement=cl.placement)

    Without root (or iproute2) ``__enter__`` raises :class:`ClusterUnavailable` saying what is
    missing, unless ``fallback_loopback=True``: then it warns and ranks run on loopback with no
    limit (``cl.emulated`` is False).
    """

    def __init__(self, world_size: int, bandwidth=None, fallback_loopback: bool = False,
                 burst_bytes: int | None = None, limit_bytes: int | None = None, topology=None):
        if not isinstance(world_size, int) or not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size must be an integer in [1, {MAX_RANKS}], got {world_size!r}")
        self.world_size = world_size
        self.topology = _as_topology(topology, world_size, bandwidth)
        self.bandwidth = self.topology.intra if self.topology else link_bandwidth(bandwidth)
        self.fallback_loopback = bool(fallback_loopback)
        self.burst_bytes = burst_bytes
        self.limit_bytes = limit_bytes
        self.emulated = False
        self.namespaces: list[str] = []
        self.bridge_ns: str | None = None
        self.subnet: str | None = None
        self.base: str | None = None
        self._owner_pid: int | None = None
        self._created: list[str] = []
        self._open = False
        self._reaper = None

    # -------------------------------------------------------------- public
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> EmulatedCluster:
        if self._open:
            raise RuntimeError("EmulatedCluster already started")
        reason = netns_unavailable_reason()
        if reason:
            self._fallback_or_raise(f"{reason}. {_HOW_TO}")
            return self
        self._owner_pid = os.getpid()
        self._open = True
        GUARD.enter(self)
        try:
            from ..launch import start_reaper

            # before the first namespace exists: a SIGKILL from here on leaves nothing behind
            self._reaper = start_reaper(namespaces_of(os.getpid()), name=b"sparsync-netns")
            self._build()
        except BaseException as e:
            self.close()
            if isinstance(e, ClusterUnavailable):
                self._fallback_or_raise(f"building the emulated network failed: {e}")
                return self
            raise
        self.emulated = True
        return self

    def placement(self, rank: int) -> dict:
        """Enter rank ``rank``'s namespace (call in the rank's own, freshly forked process).

        Returns the rank's environment: ``GLOO_SOCKET_IFNAME``; with a topology also
        ``SPARSYNC_SITES`` (the layout, :func:`sparsync.sites.site_layout` reads it); and
        ``SPARSYNC_NETNS``, with which :func:`links_from_env` lets a rank change link rates mid-run."""
        sites = {SITES_ENV: format_layout(self.topology.layout)} if self.topology else {}
        if not self.emulated:
            return {"GLOO_SOCKET_IFNAME": "lo", **sites}
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        setns(os.path.join(NETNS_DIR, self.namespaces[rank]))
        return {"GLOO_SOCKET_IFNAME": IFNAME, NETNS_ENV: self.links.env(), **sites}

    @property
    def links(self) -> Links:
        """The shaped links of this instance (:class:`Links`: ``set_rate``, ``rates``)."""
        if not self.emulated:
            raise ClusterUnavailable("no emulated links: the cluster is not started (or runs on loopback)")
        return self._make_links()

    def _make_links(self) -> Links:
        return Links(self.base, self.world_size, self.topology.sites if self.topology else 0,
                     self.burst_bytes, self.limit_bytes)

    def set_rate(self, link="inter", rate=None) -> None:
        """Change link rates now, while ranks run (``tc qdisc replace``; :meth:`Links.set_rate`)."""
        self.links.set_rate(link, rate)

    def rates(self, link="all") -> dict[str, int | None]:
        """The rate tc reports for every end of the links named ``link`` (:meth:`Links.rates`)."""
        return self.links.rates(link)

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def close(self) -> None:
        """Delete every namespace of this instance (idempotent; only the creating process does it)."""
        if not self._open or os.getpid() != self._owner_pid:
            return
        self._open = False
        try:
            failed = delete_namespaces(reversed(self._created))
        finally:
            from ..launch import stop_reaper

            stop_reaper(self._reaper)
            self._reaper = None
            self._created = []
            self.emulated = False
            GUARD.leave(self)
        if failed:
            warnings.warn("sparsync cluster: could not delete " + "; ".join(failed)
                          + " - run `sparsync cluster cleanup`", RuntimeWarning, stacklevel=2)

    def ns_exec(self, rank: int | str, *cmd: str) -> str:
        """Run a command inside a rank's namespace (``"br"``: the (inter-site) bridge's, ``"b<site>"``: a
        site bridge's); returns stdout."""
        ns = self.base + rank if isinstance(rank, str) else self.namespaces[int(rank)]
        return run(["ip", "netns", "exec", ns, *cmd], f"running {cmd[0]} in {ns}")

    def __repr__(self) -> str:
        net = f"{self.subnet}.0/24 via {self.bridge_ns}" if self.emulated else "loopback"
        if self.topology:
            return f"EmulatedCluster(world_size={self.world_size}, topology={self.topology.spec()}, {net})"
        return f"EmulatedCluster(world_size={self.world_size}, bandwidth={format_bandwidth(self.bandwidth)}, {net})"

    # -------------------------------------------------------------- internals
    def _fallback_or_raise(self, msg: str) -> None:
        if not self.fallback_loopback:
            raise ClusterUnavailable(msg)
        warnings.warn(f"sparsync: NOT emulating a network ({msg}); ranks run on LOOPBACK with NO "
                      "bandwidth limit - timings are not those of a slow network.", RuntimeWarning,
                      stacklevel=3)
        self.emulated = False

    def _build(self) -> None:
        sites = self.topology.sites if self.topology else 0
        names = claim(self.world_size, sites, self._created)
        self.base, self.subnet, self.bridge_ns, self.namespaces = (names.base, names.subnet, names.bridge_ns,
                                                                    names.namespaces)
        wire(names, self.topology, self.bandwidth, self.burst_bytes, self.limit_bytes)


def open_network(network: str, world_size: int, fallback_loopback: bool = False) -> Loopback | EmulatedCluster:
    """The network named ``network`` as a context manager giving ``.placement`` for ``run_local``:
    :class:`Loopback` for ``"loopback"``, else an :class:`EmulatedCluster` at that rate (``"none"``:
    emulated links without a limit)."""
    if network == "loopback":
        return Loopback(world_size)
    if is_topology_spec(network):
        return EmulatedCluster(world_size, topology=network, fallback_loopback=fallback_loopback)
    return EmulatedCluster(world_size, bandwidth=network, fallback_loopback=fallback_loopback)


def network_label(network: str, net) -> str:
    """How results name the network: ``network``, or ``"<network>->loopback"`` when an emulated network
    was asked for and ``fallback_loopback`` ran on loopback instead."""
    return network if (network == "loopback" or net.emulated) else f"{network}->loopback"


def run_emulated(fn: Callable, world_size: int, *args, bandwidth="1gbit", fallback_loopback: bool = False,
                 timeout: float = 300.0, topology=None, **kwargs) -> list:
    """``run_local(fn, world_size, *args, backend="gloo", **kwargs)`` on a fresh EmulatedCluster.

    ``topology`` (a :class:`~sparsync.sites.Topology` or ``"2x2@10gbit/200mbit"``; a ``bandwidth``
    string of that form means the same): sites with their own switch joined by shaped uplinks,
    instead of one switch at ``bandwidth``."""
    from ..launch import run_local

    if topology is None and is_topology_spec(bandwidth):
        topology = bandwidth
    if topology is not None:
        bandwidth = None
    with EmulatedCluster(world_size, bandwidth=bandwidth, fallback_loopback=fallback_loopback,
                         topology=topology) as cl:
        return run_local(fn, world_size, *args, backend="gloo", timeout=timeout, placement=cl.placement,
                         **kwargs)
