"""Namespaces, bridges and veth pairs of one emulated cluster instance (flat, or sites joined by uplinks).

Flat, ``P`` ranks behind one switch::

    rank ns  <base>r0: lo, eth0 10.157.<s>.1/24 --veth--> v0 \
    rank ns  <base>r1: lo, eth0 10.157.<s>.2/24 --veth--> v1 -- br0 (Linux bridge) in ns <base>br
    ...                                                     /

With a topology of ``S`` sites (:class:`sparsync.sites.Topology`), rank ``r``'s port ``v<r>`` is on
the bridge of its site's namespace ``<base>b<a>``, and every site bridge has an uplink (``wan`` on
its side, ``s<a>`` on the inter-site bridge in ``<base>br``) shaped at the topology's inter-site rate.

Every rank has its own namespace with ``lo`` up and one veth end ``eth0``; nothing is created in the
caller's namespace. The namespaces get only the connected route of their /24 - no default route, no
route out, no forwarding to the host. With a bandwidth, both ends of every host link are shaped
(:func:`~sparsync.cluster.links.shape`): a rank's egress on ``eth0``, its ingress on ``v<r>``.
The subnet ``s`` is unique among live instances: it is chosen, and the names that encode it claimed
(``ip netns add``), under a file lock (:func:`~sparsync.cluster.system.lock_file`).
"""

from __future__ import annotations

import fcntl
import itertools
import os
from dataclasses import dataclass

from .links import Links, shape
from .system import (BRIDGE, IFNAME, NAME_RE, NETNS_DIR, PREFIX, SUBNET_BASE, UPLINK, ClusterUnavailable,
                     list_namespaces, lock_file, run)

__all__ = ["MAX_RANKS", "Names", "claim", "wire"]

MAX_RANKS = 253  # host addresses .1 .. .253 of the /24 (rank r is .r+1); .254 spare, .255 broadcast
_counter = itertools.count()


@dataclass
class Names:
    """The names of one instance: ``base`` (``ssync<pid>s<subnet>``), ``subnet`` (``10.157.<s>``), the
    bridge namespace, one namespace per rank and one per site (empty when flat)."""

    base: str
    subnet: str
    bridge_ns: str
    namespaces: list[str]
    site_ns: list[str]

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"


def claim(world_size: int, sites: int, created: list[str]) -> Names:
    """Pick a free subnet and create the instance's namespaces under the lock; each namespace is
    appended to ``created`` as soon as it exists (so a failure part-way leaves nothing unrecorded)."""
    os.makedirs(NETNS_DIR, exist_ok=True)
    with lock_file() as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        used = {int(m.group(2)) for m in map(NAME_RE.match, list_namespaces()) if m}
        free = [s for s in range(1, 255) if s not in used]
        if not free:
            raise ClusterUnavailable("no free 10.157.<s>.0/24 subnet: 254 clusters exist; "
                                     "run `sparsync cluster cleanup`")
        s = free[(os.getpid() + next(_counter)) % len(free)]
        base = f"{PREFIX}{os.getpid()}s{s}"
        names = Names(base, f"{SUBNET_BASE}.{s}", base + "br", [f"{base}r{r}" for r in range(world_size)],
                      [f"{base}b{a}" for a in range(sites)])
        for ns in [names.bridge_ns] + names.site_ns + names.namespaces:  # names claimed under the lock
            run(["ip", "netns", "add", ns], "creating network namespace")
            created.append(ns)
    return names


def wire(names: Names, topology=None, bandwidth: int | None = None, burst_bytes: int | None = None,
         limit_bytes: int | None = None) -> None:
    """Bridges, uplinks (with a topology), one veth pair and address per rank, and the tbf of every link."""
    site_ns = names.site_ns
    for br in [names.bridge_ns] + site_ns:
        run(["ip", "-n", br, "link", "set", "lo", "up"], "bridge namespace lo")
        run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"], "creating the bridge")
        run(["ip", "-n", br, "link", "set", BRIDGE, "up"], "bringing the bridge up")
    for a, sb in enumerate(site_ns):  # site a's uplink: "wan" on its bridge <-> "s<a>" on the inter-site bridge
        run(["ip", "-n", sb, "link", "add", UPLINK, "type", "veth", "peer", "name", f"s{a}",
             "netns", names.bridge_ns], f"creating site {a}'s uplink")
        run(["ip", "-n", sb, "link", "set", UPLINK, "master", BRIDGE, "up"], f"site {a}'s uplink")
        run(["ip", "-n", names.bridge_ns, "link", "set", f"s{a}", "master", BRIDGE, "up"], f"site {a}'s uplink")
    if topology is not None and topology.inter is not None:
        Links(names.base, len(names.namespaces), len(site_ns), burst_bytes, limit_bytes).set_rate(
            "inter", topology.inter)
    for r, ns in enumerate(names.namespaces):
        port = f"v{r}"
        br = site_ns[topology.site_of(r)] if topology is not None else names.bridge_ns
        run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns],
            f"creating the veth pair of rank {r}")
        run(["ip", "-n", br, "link", "set", port, "master", BRIDGE, "up"], f"attaching rank {r} to the bridge")
        run(["ip", "-n", ns, "link", "set", "lo", "up"], f"rank {r} lo")
        run(["ip", "-n", ns, "addr", "add", f"{names.address(r)}/24", "dev", IFNAME], f"rank {r} address")
        run(["ip", "-n", ns, "link", "set", IFNAME, "up"], f"rank {r} {IFNAME} up")
        if bandwidth is not None:
            for where, dev in ((ns, IFNAME), (br, port)):
                shape(where, dev, bandwidth, burst_bytes, limit_bytes, what=f"limiting rank {r}'s link")

