"""What crashed runs leave behind, found by name and removed (``sparsync cluster cleanup``).

Every namespace carries its owner's pid (``ssync<pid>s...``), every rank process its launcher's
(``ss<pid>r<rank>``, :func:`sparsync.launch.rank_process_name`), every rendezvous store its
launcher's (``sparsync-store-<pid>-*``, :data:`sparsync.launch.STORE_PREFIX`): whatever has a dead
owner is stale. :func:`namespaces_of` is the cleanup a cluster's reaper process runs when its owner
is killed outright (SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable

from .system import NAME_RE, PREFIX, delete_namespaces, list_namespaces, pid_alive

__all__ = ["cleanup_stale", "namespaces_of", "stale_rank_processes", "stale_stores"]

_RANK_PROC_RE = re.compile(r"^ss(\d+)r(\d+)$")  # launch.rank_process_name
_STORE_RE = re.compile(r"^sparsync-store-(\d+)-")  # launch.STORE_PREFIX + launcher pid


def namespaces_of(pid: int) -> Callable[[], None]:
    """The reaper's cleanup: delete every namespace process ``pid`` made (``ssync<pid>s*``), twice - an
    ``ip netns add`` the dead process had started may still finish in between."""
    def cleanup():
        for pause in (0.0, 0.5):
            time.sleep(pause)
            delete_namespaces([n for n in list_namespaces() if n.startswith(f"{PREFIX}{pid}s")])

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
        if m and int(pid) != os.getpid() and (all_instances or not pid_alive(int(m.group(1)))):
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
                    and (all_instances or not pid_alive(int(m.group(1))))):
                out.append(path)
    return out


def _stale_links(all_instances: bool) -> list[str]:
    """Root-namespace links of our name pattern with a dead owner: no version creates them now, but an
    interrupted older one may have left some."""
    if not shutil.which("ip"):
        return []
    links = []
    out = subprocess.run(["ip", "-o", "link", "show"], check=False, capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            m = NAME_RE.match(name)
            if m and (all_instances or not pid_alive(int(m.group(1)))):
                links.append(name)
    return links


def cleanup_stale(all_instances: bool = False, namespaces: bool = True) -> list[str]:
    """Remove what crashed runs left: rank processes whose launcher is gone, their rendezvous stores,
    and namespaces with our prefix and a dead owner pid (any owner with ``all_instances=True`` - that
    also breaks runs that are alive now). ``namespaces=False``: processes and stores only (no root
    needed). Returns what was removed, one description each.
    """
    removed = []
    ours = [(n, NAME_RE.match(n)) for n in (list_namespaces() if namespaces else [])]
    victims = [n for n, m in ours if m and (all_instances or not pid_alive(int(m.group(1))))]
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
    links = _stale_links(all_instances) if namespaces else []
    for link in links:
        subprocess.run(["ip", "link", "delete", link], check=False, capture_output=True)
    failed = delete_namespaces(victims)
    if failed:
        raise RuntimeError("could not delete: " + "; ".join(failed))
    return removed + victims + [f"link {x}" for x in links]
