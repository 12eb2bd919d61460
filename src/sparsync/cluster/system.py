"""The emulated network's contact with the system: names, privileges, ``ip``/``tc`` calls, ``setns``.

Names: every namespace of one cluster instance is ``ssync<owner pid>s<subnet>`` followed by
``r<rank>`` (a rank), ``br`` (the bridge, or the inter-site bridge) or ``b<site>`` (a site's bridge),
so the owner of any namespace can be read off its name (:data:`NAME_RE`). Addresses come from
``10.157.<subnet>.0/24``, never routed anywhere.

iproute2 is driven through ``subprocess`` (:func:`run`: ``check``-ed, stderr in the error) rather
than pyroute2, whose 0.9 series rewrote its API; the only syscall issued here is ``setns`` (via libc).
Building needs root, or CAP_NET_ADMIN + CAP_SYS_ADMIN (:func:`netns_unavailable_reason`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess

__all__ = ["BRIDGE", "IFNAME", "NETNS_DIR", "NETNS_ENV", "PREFIX", "SUBNET_BASE", "UPLINK", "ClusterUnavailable",
           "delete_namespaces", "list_namespaces", "lock_file", "netns_unavailable_reason", "pid_alive", "run",
           "setns"]

PREFIX = "ssync"
SUBNET_BASE = "10.157"  # 10.157.<s>.0/24, s in 1..254, never routed anywhere
IFNAME = "eth0"
BRIDGE = "br0"
UPLINK = "wan"  # a site bridge's end of its uplink to the inter-site bridge (whose end is ``s<site>``)
NETNS_ENV = "SPARSYNC_NETNS"  # set by placement: "<base>:<world size>:<sites>", for rate changes from a rank
NETNS_DIR = "/var/run/netns"
NAME_RE = re.compile(rf"^{PREFIX}(\d+)s(\d+)(r\d+|br|b\d+)$")  # rank, core bridge, site bridge
_LOCK_DIR = "/run/sparsync"  # root-only, not the world-writable /tmp (no planted links)
_CLONE_NEWNET = 0x40000000  # <linux/sched.h>: setns() into a network namespace
_CAP_NET_ADMIN = 12  # <linux/capability.h> bit numbers, read from /proc/self/status CapEff
_CAP_SYS_ADMIN = 21


class ClusterUnavailable(RuntimeError):
    """The emulated network cannot be built here (no root/CAP_NET_ADMIN, no iproute2, ...)."""


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


def run(cmd: list[str], what: str) -> str:
    """Run one iproute2 command; its stdout, or :class:`ClusterUnavailable` naming ``what`` failed and why."""
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


def delete_namespaces(names) -> list[str]:
    """Delete namespaces (their veths and bridge go with them); returns those that failed."""
    failed = []
    for ns in names:
        p = subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True, text=True, timeout=30)
        if p.returncode != 0 and os.path.exists(os.path.join(NETNS_DIR, ns)):
            failed.append(f"{ns}: {p.stderr.strip()}")
    return failed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_libc = None


def setns(path: str) -> None:
    """Move this process into the network namespace at ``path`` (``setns(fd, CLONE_NEWNET)``): call it
    while the process is single-threaded (right after fork); threads started later inherit it."""
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


def lock_file():
    """The subnet-allocation lock: ``/run/sparsync/cluster.lock`` in a root-only directory, opened
    with O_NOFOLLOW (no symlink planted by another user can redirect it)."""
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(_LOCK_DIR)
    if not os.path.isdir(_LOCK_DIR) or os.path.islink(_LOCK_DIR) or st.st_uid != os.geteuid():
        raise ClusterUnavailable(f"{_LOCK_DIR} is not a directory owned by this user; remove it")
    fd = os.open(os.path.join(_LOCK_DIR, "cluster.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    return os.fdopen(fd, "r+")
