"""Emulated cluster: P ranks on one machine, each behind its own bandwidth-limited network link.

Why: on loopback (~5 GB/s, ``DESIGN.md`` "Running real ranks on this machine") sparse methods rarely
beat a dense all-reduce; their gains show on slow links. This module builds such links with Linux
network namespaces so that real gloo processes talk over real TCP through a rate limiter.

Topology of one instance (names are unique per instance: ``ssync<pid>s<subnet>``)::

    rank ns  <base>r0: lo, eth0 10.157.<s>.1/24 --veth--> v0 \
    rank ns  <base>r1: lo, eth0 10.157.<s>.2/24 --veth--> v1 -- br0 (Linux bridge) in ns <base>br
    ...                                                     /

* every rank has its own network namespace with ``lo`` up and one veth end ``eth0``; the other end
  ``v<r>`` is a port of the bridge ``br0`` in a separate bridge namespace. Nothing is created in the
  caller's namespace.
* addresses come from a private /24 (``10.157.<s>.0/24``, ``s`` unique among live instances,
  allocated under a file lock and encoded in the namespace names); the namespaces get only the
  connected route of that /24 - **no default route, no route out**, no forwarding to the host.
* with ``bandwidth`` set, ``tc qdisc replace dev <veth> root tbf rate <bw> burst <b> limit <l>`` is
  applied on BOTH ends of every veth, so every host link is limited in both directions (a rank's
  egress on ``eth0``, its ingress on the bridge side ``v<r>``). ``burst`` is at least 64 KiB (one
  TSO/GSO super-packet; a smaller bucket makes tbf segment or drop them) and about 1 ms of traffic;
  ``limit`` (queue) is about 20 ms of traffic, so TCP reaches ~95% of the line rate without a
  bloated queue. netem is not in this kernel, so no latency is added (propagation ~ 0).
* ``cl.placement(rank)`` runs in the forked rank process before its gloo group starts
  (``run_local(..., placement=cl.placement)``): it enters the rank's namespace with
  ``setns(fd, CLONE_NEWNET)`` (the process is single-threaded right after fork, and threads gloo
  creates later inherit the namespace) and returns ``{"GLOO_SOCKET_IFNAME": "eth0"}``. Rendezvous is
  a FileStore, which works across network namespaces.

Cleanup always happens: ``__exit__``, an ``atexit`` hook, and SIGINT/SIGTERM handlers that clean
up and then chain to the previous handler. Deleting the namespaces deletes their veths and bridge.
When the process is killed (SIGKILL) - while the cluster is being built, or while ranks run on it
- the cluster's own reaper process (:func:`sparsync.launch.start_reaper`), forked before the first
namespace is made, deletes every namespace of this process (``ssync<pid>s*``); the ranks die with
their parent.
``sparsync cluster cleanup`` (:func:`cleanup_stale`) removes whatever is still left: every
namespace with our prefix whose owner process is gone, rank processes (``ss<pid>r<rank>``) of dead
launchers and anything running inside the stale namespaces, and stale ``sparsync-store-<pid>-*``
rendezvous directories. The subnet lock is ``/run/sparsync/cluster.lock`` (root-only directory,
opened with ``O_NOFOLLOW``).

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``). We drive iproute2
through ``subprocess`` (``check``-ed, stderr in the error) rather than pyroute2: its 0.9 series
rewrote the API, and iproute2 is what the test fixture requires anyway; the only syscall we
issue ourselves is ``setns`` (via libc).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import fcntl
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from .sites import SITES_ENV, format_layout, is_topology_spec

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "PREFIX",
    "ClusterUnavailable",
    "EmulatedCluster",
    "Loopback",
    "cleanup_stale",
    "stale_rank_processes",
    "stale_stores",
    "format_bandwidth",
    "list_namespaces",
    "netns_unavailable_reason",
    "network_label",
    "open_network",
    "parse_bandwidth",
    "run_emulated",
    "Links",
    "change_rate",
    "links_from_env",
    "parse_rate_schedule",
]

PREFIX = "ssync"
SUBNET_BASE = "10.157"  # 10.157.<s>.0/24, s in 1..254, never routed anywhere
IFNAME = "eth0"
BRIDGE = "br0"
UPLINK = "wan"  # a site bridge's end of its uplink to the inter-site bridge (whose end is ``s<site>``)
NETNS_ENV = "SPARSYNC_NETNS"  # set by placement: "<base>:<world size>:<sites>", for rate changes from a rank
NETNS_DIR = "/var/run/netns"
_LOCK_DIR = "/run/sparsync"  # root-only, not the world-writable /tmp (no planted links)
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)s(\d+)(r\d+|br|b\d+)$")  # rank, core bridge, site bridge
_RANK_PROC_RE = re.compile(r"^ss(\d+)r(\d+)$")  # launch.rank_process_name
_STORE_RE = re.compile(r"^sparsync-store-(\d+)-")  # launch.STORE_PREFIX + launcher pid
_CLONE_NEWNET = 0x40000000  # <linux/sched.h>: setns() into a network namespace
_CAP_NET_ADMIN = 12  # <linux/capability.h> bit numbers, read from /proc/self/status CapEff
_CAP_SYS_ADMIN = 21
_MAX_RANKS = 253  # host addresses .1 .. .253 of the /24 (rank r is .r+1); .254 spare, .255 broadcast
# tbf parameters (module docstring): the bucket holds one TSO/GSO super-packet (64 KiB) plus one
# Ethernet frame (1514 bytes with header) - smaller, tbf segments or drops them - and at least
# _BURST_S of traffic; the queue holds _QUEUE_S of traffic (~95% of line rate for TCP, no bloat).
_TSO_MAX = 65536
_ETH_FRAME = 1514
_BURST_S = 1e-3
_QUEUE_S = 20e-3

_counter = itertools.count()
MAX_BANDWIDTH = 10**12  # bits/s; 20 ms of it in bytes stays below 2^32


class ClusterUnavailable(RuntimeError):
    """The emulated network cannot be built here (no root/CAP_NET_ADMIN, no iproute2, ...)."""


# ---------------------------------------------------------------------- bandwidth
def parse_bandwidth(bw) -> int | None:
    """Bits per second for tc from ``"1gbit"``, ``"100mbit"``, ``"125MB/s"``, a number (bits/s) —
    :func:`sparsync.units.parse_rate`'s one rule (the ambiguous ``gbps`` family is refused);
    ``None``/``"none"``/``"unlimited"`` -> None (no limit)."""
    from .units import parse_rate

    if bw is None or (isinstance(bw, str) and bw.strip().lower() in ("none", "unlimited", "inf", "")):
        return None
    try:
        val = parse_rate(bw)
    except ValueError as e:
        raise ValueError(f"bad bandwidth: {e}") from None
    if not val >= 8000:  # 1 kB/s: lower is a unit mistake (the 64 KiB tbf bucket alone takes a minute)
        raise ValueError(f"bandwidth must be at least 8kbit, got {bw!r}")
    return int(val)


def link_bandwidth(bw) -> int | None:
    """:func:`parse_bandwidth`, bounded by what an emulated link can hold: at most
    :data:`MAX_BANDWIDTH` (tbf's queue of 20 ms of traffic is a 32-bit byte count)."""
    val = parse_bandwidth(bw)
    if val is not None and not val <= MAX_BANDWIDTH:
        raise ValueError(f"bandwidth must be at most {format_bandwidth(MAX_BANDWIDTH)} for an emulated link (tc's "
                         f"token bucket holds {_QUEUE_S * 1e3:g} ms of traffic in a 32-bit byte count), got {bw!r}")
    return val


def format_bandwidth(bits: int | None) -> str:
    if bits is None:
        return "unlimited"
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= f:
            v = bits / f
            return f"{v:g}{unit}"
    return f"{bits}bit"


# ---------------------------------------------------------------------- system helpers
def _cap_effective() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def netns_unavailable_reason() -> str | None:
    """Why the emulated network cannot be built here, or None when it can."""
    caps = _cap_effective()
    if os.geteuid() != 0 and not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        return ("the emulated cluster needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) to create network "
                "namespaces, veth pairs and tc qdiscs")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"the emulated cluster needs iproute2 ('{tool}' not found on PATH; apt-get install iproute2)"
    return None


_HOW_TO = ("Run it as root (e.g. `sudo .venv/bin/sparsync ...`), or run on loopback without a "
           "bandwidth limit instead: EmulatedCluster(..., fallback_loopback=True) / "
           "run_emulated(..., fallback_loopback=True) / `--bandwidth loopback` on the CLI.")


def _run(cmd: list[str], what: str) -> str:
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise ClusterUnavailable(f"{what}: {cmd[0]} not found ({e}); install iproute2") from None
    except subprocess.TimeoutExpired:
        raise ClusterUnavailable(f"{what}: `{' '.join(cmd)}` timed out") from None
    if p.returncode != 0:
        raise ClusterUnavailable(f"{what}: `{' '.join(cmd)}` failed (exit {p.returncode}): "
                                 f"{(p.stderr or p.stdout).strip()}")
    return p.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    if not shutil.which("ip"):
        return []
    try:
        out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespaces(names) -> list[str]:
    """Delete namespaces (their veths and bridge go with them); returns those that failed."""
    failed = []
    for ns in names:
        p = subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True, text=True, timeout=30)
        if p.returncode != 0 and os.path.exists(os.path.join(NETNS_DIR, ns)):
            failed.append(f"{ns}: {p.stderr.strip()}")
    return failed


def _namespaces_of(pid: int) -> Callable[[], None]:
    """The reaper's cleanup: delete every namespace process ``pid`` made (``ssync<pid>s*``), twice - an
    ``ip netns add`` the dead process had started may still finish in between."""
    def cleanup():
        for pause in (0.0, 0.5):
            time.sleep(pause)
            _delete_namespaces([n for n in list_namespaces() if n.startswith(f"{PREFIX}{pid}s")])

    return cleanup


def _proc_comm(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _namespace_pids(ns: str) -> list[int]:
    try:
        out = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(x) for x in out.split() if x.isdigit()]


def stale_rank_processes(all_instances: bool = False) -> list[int]:
    """Pids of rank processes (``ss<launcher pid>r<rank>``) whose launcher is gone."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        m = _RANK_PROC_RE.match(_proc_comm(pid) or "")
        if m and int(pid) != os.getpid() and (all_instances or not _pid_alive(int(m.group(1)))):
            out.append(int(pid))
    return out


def stale_stores(all_instances: bool = False) -> list[str]:
    """``sparsync-store-<pid>-*`` rendezvous directories of launchers that are gone."""
    tmp = tempfile.gettempdir()
    out = []
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            m = _STORE_RE.match(name)
            path = os.path.join(tmp, name)
            if (m and os.path.isdir(path) and not os.path.islink(path)
                    and (all_instances or not _pid_alive(int(m.group(1))))):
                out.append(path)
    return out


def cleanup_stale(all_instances: bool = False, namespaces: bool = True) -> list[str]:
    """Remove what crashed runs left: rank processes whose launcher is gone, their rendezvous stores,
    and namespaces with our prefix and a dead owner pid (any owner with ``all_instances=True`` - that
    also breaks runs that are alive now). ``namespaces=False``: processes and stores only (no root
    needed). Returns what was removed, one description each.
    """
    removed = []
    ours = [(n, _NAME_RE.match(n)) for n in (list_namespaces() if namespaces else [])]
    victims = [n for n, m in ours if m and (all_instances or not _pid_alive(int(m.group(1))))]
    procs = set(stale_rank_processes(all_instances))
    for ns in victims:  # anything still running inside a namespace we are about to delete
        procs.update(_namespace_pids(ns))
    for pid in sorted(procs):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid}")
    for path in stale_stores(all_instances):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(f"store {path}")
    # root-namespace links: this module creates none, but an interrupted older version may have
    # left some; only names of our own pattern with a dead owner
    links = []
    if namespaces and shutil.which("ip"):
        out = subprocess.run(["ip", "-o", "link", "show"], check=False, capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split(":")
            if len(parts) > 1:
                name = parts[1].strip().split("@")[0]
                m = _NAME_RE.match(name)
                if m and (all_instances or not _pid_alive(int(m.group(1)))):
                    links.append(name)
    for link in links:
        subprocess.run(["ip", "link", "delete", link], check=False, capture_output=True)
    failed = _delete_namespaces(victims)
    if failed:
        raise RuntimeError("could not delete: " + "; ".join(failed))
    return removed + victims + [f"link {x}" for x in links]


_libc = None


def _setns(path: str) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- signal / atexit plumbing
_LIVE: set[EmulatedCluster] = set()
_PREV_HANDLERS: dict[int, object] = {}
_plumbing_lock = threading.Lock()


def _cleanup_live() -> None:
    for cl in list(_LIVE):
        cl.close()


def _on_signal(signum, frame):
    _cleanup_live()
    prev = _PREV_HANDLERS.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_IGN:
        return
    else:  # SIG_DFL: restore and re-deliver, so the process dies the way it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    if _PREV_HANDLERS or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)
        if prev is None:  # installed from C; we cannot chain it, leave it alone
            continue
        _PREV_HANDLERS[sig] = prev
        signal.signal(sig, _on_signal)


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, prev in list(_PREV_HANDLERS.items()):
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, prev)
        del _PREV_HANDLERS[sig]


def _lock_file():
    """The subnet-allocation lock: ``/run/sparsync/cluster.lock`` in a root-only directory, opened
    with O_NOFOLLOW (no symlink planted by another user can redirect it)."""
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(_LOCK_DIR)
    if not os.path.isdir(_LOCK_DIR) or os.path.islink(_LOCK_DIR) or st.st_uid != os.geteuid():
        raise ClusterUnavailable(f"{_LOCK_DIR} is not a directory owned by this user; remove it")
    fd = os.open(os.path.join(_LOCK_DIR, "cluster.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    return os.fdopen(fd, "r+")


# ---------------------------------------------------------------------- shaped links
def _tbf_params(bandwidth: int, burst_bytes: int | None = None, limit_bytes: int | None = None) -> tuple[int, int]:
    """(burst, limit) bytes of the tbf at ``bandwidth`` bits/s (module docstring)."""
    rate_Bps = bandwidth / 8
    burst = burst_bytes or max(_TSO_MAX + _ETH_FRAME, int(rate_Bps * _BURST_S))
    limit = limit_bytes or max(4 * burst, int(rate_Bps * _QUEUE_S))
    return burst, limit


_TC_RATE_RE = re.compile(r"\btbf\b.*?\brate (\d+(?:\.\d+)?)([KMG]?)bit", re.S)


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
        bits = parse_bandwidth(rate)
        for suffix, dev in self.ends(link):
            ns = self.base + suffix
            if bits is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False,
                               capture_output=True, timeout=30)  # no qdisc there already: nothing to do
                continue
            burst, limit = _tbf_params(bits, self.burst_bytes, self.limit_bytes)
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                  "burst", str(burst), "limit", str(limit)],
                 f"limiting {ns}:{dev} to {format_bandwidth(bits)} (is sch_tbf available?)")

    def rates(self, link="all") -> dict[str, int | None]:
        """``{"<ns suffix>:<dev>": bits/s or None}`` as tc reports it now."""
        out = {}
        for suffix, dev in self.ends(link):
            text = _run(["tc", "-n", self.base + suffix, "qdisc", "show", "dev", dev], "reading a qdisc")
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
    ValueError in one line for anything else."""
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
        out[k] = parse_bandwidth(rate)
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


def _as_topology(topology, world_size: int, bandwidth):
    """``topology`` (a :class:`~sparsync.sites.Topology` or its spec string) checked against the world
    size, or None; a bandwidth beside a topology is refused (``intra`` / ``inter`` say the rates)."""
    if topology is None:
        return None
    from .sites import Topology

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
        if not isinstance(world_size, int) or not 1 <= world_size <= _MAX_RANKS:
            raise ValueError(f"world_size must be an integer in [1, {_MAX_RANKS}], got {world_size!r}")
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
        with _plumbing_lock:
            _LIVE.add(self)
            _install_handlers()
        atexit.register(self.close)
        try:
            from .launch import start_reaper

            # before the first namespace exists: a SIGKILL from here on leaves nothing behind
            self._reaper = start_reaper(_namespaces_of(os.getpid()), name=b"sparsync-netns")
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
        _setns(os.path.join(NETNS_DIR, self.namespaces[rank]))
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
            failed = _delete_namespaces(reversed(self._created))
        finally:
            from .launch import stop_reaper

            stop_reaper(self._reaper)
            self._reaper = None
            self._created = []
            self.emulated = False
            with _plumbing_lock:
                _LIVE.discard(self)
                if not _LIVE:
                    _restore_handlers()
            with contextlib.suppress(Exception):  # may run from inside atexit itself
                atexit.unregister(self.close)
        if failed:
            warnings.warn("sparsync cluster: could not delete " + "; ".join(failed)
                          + " - run `sparsync cluster cleanup`", RuntimeWarning, stacklevel=2)

    def ns_exec(self, rank: int | str, *cmd: str) -> str:
        """Run a command inside a rank's namespace (``"br"``: the (inter-site) bridge's, ``"b<site>"``: a
        site bridge's); returns stdout."""
        ns = self.base + rank if isinstance(rank, str) else self.namespaces[int(rank)]
        return _run(["ip", "netns", "exec", ns, *cmd], f"running {cmd[0]} in {ns}")

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

    def _tbf_params(self) -> tuple[int, int]:
        return _tbf_params(self.bandwidth, self.burst_bytes, self.limit_bytes)

    def _build(self) -> None:
        os.makedirs(NETNS_DIR, exist_ok=True)
        with _lock_file() as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            used = {int(m.group(2)) for m in map(_NAME_RE.match, list_namespaces()) if m}
            free = [s for s in range(1, 255) if s not in used]
            if not free:
                raise ClusterUnavailable("no free 10.157.<s>.0/24 subnet: 254 clusters exist; "
                                         "run `sparsync cluster cleanup`")
            s = free[(os.getpid() + next(_counter)) % len(free)]
            self.base = f"{PREFIX}{os.getpid()}s{s}"
            self.subnet = f"{SUBNET_BASE}.{s}"
            self.bridge_ns = self.base + "br"
            self.namespaces = [f"{self.base}r{r}" for r in range(self.world_size)]
            site_ns = [f"{self.base}b{a}" for a in range(self.topology.sites)] if self.topology else []
            for ns in [self.bridge_ns] + site_ns + self.namespaces:  # names claimed under the lock
                _run(["ip", "netns", "add", ns], "creating network namespace")
                self._created.append(ns)
        for br in [self.bridge_ns] + site_ns:
            _run(["ip", "-n", br, "link", "set", "lo", "up"], "bridge namespace lo")
            _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"], "creating the bridge")
            _run(["ip", "-n", br, "link", "set", BRIDGE, "up"], "bringing the bridge up")
        for a, sb in enumerate(site_ns):  # site a's uplink: "up" on its bridge <-> "s<a>" on the inter-site bridge
            _run(["ip", "-n", sb, "link", "add", UPLINK, "type", "veth", "peer", "name", f"s{a}",
                  "netns", self.bridge_ns], f"creating site {a}'s uplink")
            _run(["ip", "-n", sb, "link", "set", UPLINK, "master", BRIDGE, "up"], f"site {a}'s uplink")
            _run(["ip", "-n", self.bridge_ns, "link", "set", f"s{a}", "master", BRIDGE, "up"], f"site {a}'s uplink")
        if self.topology and self.topology.inter is not None:
            self._make_links().set_rate("inter", self.topology.inter)
        for r, ns in enumerate(self.namespaces):
            port = f"v{r}"
            br = site_ns[self.topology.site_of(r)] if self.topology else self.bridge_ns
            _run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns],
                 f"creating the veth pair of rank {r}")
            _run(["ip", "-n", br, "link", "set", port, "master", BRIDGE, "up"], f"attaching rank {r} to the bridge")
            _run(["ip", "-n", ns, "link", "set", "lo", "up"], f"rank {r} lo")
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", IFNAME], f"rank {r} address")
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"], f"rank {r} {IFNAME} up")
            if self.bandwidth is not None:
                burst, limit = self._tbf_params()
                for where, dev in ((ns, IFNAME), (br, port)):
                    _run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf",
                          "rate", f"{self.bandwidth}bit", "burst", str(burst), "limit", str(limit)],
                         f"limiting rank {r}'s link to {format_bandwidth(self.bandwidth)} (is sch_tbf available?)")


class Loopback:
    """The null network: :class:`EmulatedCluster`'s interface (a context manager with ``placement``,
    ``emulated``, ``bandwidth``, ``world_size``) over ``lo``, nothing built and no rate limit.

    What ``"loopback"`` means everywhere a network is named (benchmarks, ``sparsync cluster smoke``),
    so callers need no branch of their own.
    """

    emulated = False
    bandwidth = None

    def __init__(self, world_size: int):
        self.world_size = int(world_size)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def placement(self, rank: int) -> dict:
        return {"GLOO_SOCKET_IFNAME": "lo"}

    def __repr__(self) -> str:
        return f"loopback ({self.world_size} ranks, no bandwidth limit)"


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
    from .launch import run_local

    if topology is None and is_topology_spec(bandwidth):
        topology = bandwidth
    if topology is not None:
        bandwidth = None
    with EmulatedCluster(world_size, bandwidth=bandwidth, fallback_loopback=fallback_loopback,
                         topology=topology) as cl:
        return run_local(fn, world_size, *args, backend="gloo", timeout=timeout, placement=cl.placement,
                         **kwargs)
