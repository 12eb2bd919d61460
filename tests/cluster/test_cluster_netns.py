"""Emulated cluster (``sparsync.cluster``): real namespaces, real rate limits, cleanup always.

Tests that build namespaces use the ``needs_netns`` fixture (skip with a reason without root or
iproute2); the no-root behaviour is tested everywhere by faking the capability check.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import sparsync as ss
from sparsync import cluster as C
from sparsync.cluster import ClusterUnavailable, EmulatedCluster, list_namespaces, run_emulated

pytestmark = pytest.mark.netns


def _ours(prefix):
    return [n for n in list_namespaces() if n.startswith(prefix)]


def _ident(comm):
    """Which network namespace and interface this rank really uses, plus a correctness check."""
    x = torch.full((1000,), float(comm.rank + 1))
    out = comm.allreduce(x)
    P = comm.world_size
    return {
        "netns": os.readlink("/proc/self/ns/net"),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "ok": bool(torch.all(out == P * (P + 1) / 2)),
        "addrs": subprocess.run(["ip", "-4", "-o", "addr"], check=False, capture_output=True, text=True).stdout,
    }


@pytest.mark.gloo
def test_smoke_two_ranks_each_in_own_namespace(needs_netns):
    with EmulatedCluster(2, bandwidth="1gbit") as cl:
        assert cl.emulated
        res = ss.run_local(_ident, 2, backend="gloo", timeout=60, placement=cl.placement)
        base = cl.base
        # names fit the kernel's 15-character interface limit and the instance's prefix is unique
        assert all(len(n) <= 15 for n in (C.IFNAME, C.BRIDGE, f"v{cl.world_size - 1}"))
        routes = [cl.ns_exec(r, "ip", "route") for r in range(2)]
        qdiscs = cl.ns_exec(0, "tc", "qdisc") + cl.ns_exec("br", "tc", "qdisc")
    assert all(r["ok"] for r in res)
    assert all(r["ifname"] == "eth0" for r in res)
    mine = os.readlink("/proc/self/ns/net")
    assert len({r["netns"] for r in res} | {mine}) == 3, "each rank must be in its own namespace"
    for r, info in enumerate(res):
        assert f"{cl.subnet}.{r + 1}/24" in info["addrs"]
    for rt in routes:  # only the connected /24, no default route, no route out
        assert "default" not in rt
        assert [ln for ln in rt.splitlines() if ln.strip()] == [ln for ln in rt.splitlines() if cl.subnet in ln]
    assert qdiscs.count("tbf") == 1 + 2 and "rate 1Gbit" in qdiscs  # eth0 of rank 0 + v0, v1
    assert _ours(base) == []


def test_no_route_out(needs_netns):
    with EmulatedCluster(2) as cl:
        rt = cl.ns_exec(0, "ip", "route")
        assert "default" not in rt
        p = subprocess.run(["ip", "netns", "exec", cl.namespaces[0], "ip", "route", "get", "1.1.1.1"],
                           check=False, capture_output=True, text=True)
        assert p.returncode != 0 and "unreachable" in p.stderr.lower()
        # the peer is reachable inside the cluster
        p = subprocess.run(["ip", "netns", "exec", cl.namespaces[0], "ip", "route", "get", cl.address(1)],
                           check=False, capture_output=True, text=True)
        assert p.returncode == 0 and "dev eth0" in p.stdout


def _timed_allreduce(comm, numel, repeats):
    x = torch.randn(numel)
    comm.allreduce(x)  # connect + warm up
    ts = []
    for _ in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce(x)
        ts.append(time.perf_counter() - t0)
    return min(ts)


@pytest.mark.gloo
def test_bandwidth_limit_is_real(needs_netns):
    n = 500_000  # 2 MB of float32; ring all-reduce on 2 ranks moves 2 MB over each link each way
    model = 2 * (2 - 1) / 2 * n * 4 * 8 / 100e6  # 0.16 s at 100 Mbit/s
    limited = max(run_emulated(_timed_allreduce, 2, n, 2, bandwidth="100mbit", timeout=60))
    unlimited = max(run_emulated(_timed_allreduce, 2, n, 3, bandwidth=None, timeout=60))
    assert limited >= 0.7 * model, (limited, model)
    # the limiter lets TCP get close to line rate (~1.05x measured; loose for a loaded machine)
    assert limited <= 3.0 * model, (limited, model)
    assert unlimited < 0.4 * model, (unlimited, model)  # much faster without the limit


def _boom(comm):
    if comm.rank == 1:
        raise ValueError("worker failed on purpose")
    comm.barrier()


@pytest.mark.gloo
def test_cleanup_even_when_worker_raises(needs_netns):
    cl = EmulatedCluster(2, bandwidth="1gbit")
    with pytest.raises(ValueError, match="on purpose"), cl:
        assert len(_ours(cl.base)) == 3
        ss.run_local(_boom, 2, backend="gloo", timeout=30, placement=cl.placement)
    assert _ours(cl.base) == []
    with pytest.raises(ValueError, match="on purpose"):
        run_emulated(_boom, 2, bandwidth=None, timeout=30)
    assert _ours(f"{C.PREFIX}{os.getpid()}s") == []


def test_instances_get_unique_names_and_subnets(needs_netns):
    with EmulatedCluster(1) as a, EmulatedCluster(1) as b:
        assert a.base != b.base and a.subnet != b.subnet
        assert set(a.namespaces).isdisjoint(b.namespaces)
    assert _ours(a.base) == [] and _ours(b.base) == []


_CHILD = textwrap.dedent("""
    import signal, sys, time
    # an interactive program's SIGINT: a run started in the background by a shell inherits it ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from sparsync.cluster import EmulatedCluster
    cl = EmulatedCluster(2, bandwidth="100mbit").start()
    print(cl.base, cl._reaper[0], flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up(needs_netns, sig):
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        base = p.stdout.readline().split()[0]
        assert base.startswith(C.PREFIX) and len(_ours(base)) == 3
        p.send_signal(sig)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0  # the signal still ends the program
    assert _ours(base) == []


def test_cleanup_command_removes_leftovers_of_killed_run(needs_netns):
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    base, reaper = p.stdout.readline().split()
    os.kill(int(reaper), signal.SIGKILL)  # the cluster's reaper first: what it would delete stays behind
    p.kill()  # SIGKILL: no handler runs, the namespaces stay behind
    p.wait(timeout=30)
    assert len(_ours(base)) == 3
    with EmulatedCluster(1) as live:  # a live instance must survive the default cleanup
        out = subprocess.run([sys.executable, "-m", "sparsync.cli", "cluster", "cleanup"],
                             check=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert base in out.stdout
        assert _ours(base) == []
        assert len(_ours(live.base)) == 2


# ---------------------------------------------------------------------- without root
def test_without_root_clear_error_or_loopback_fallback(monkeypatch):
    monkeypatch.setattr(C, "netns_unavailable_reason", lambda: "the emulated cluster needs root (fake)")
    with pytest.raises(ClusterUnavailable, match="root") as ei, EmulatedCluster(2, bandwidth="1gbit"):
        pass
    assert "fallback_loopback=True" in str(ei.value) and "loopback" in str(ei.value)
    cl = EmulatedCluster(2, bandwidth="1gbit", fallback_loopback=True)
    with pytest.warns(RuntimeWarning, match="LOOPBACK"):
        cl.start()
    assert not cl.emulated
    assert cl.placement(0) == {"GLOO_SOCKET_IFNAME": "lo"}
    cl.close()
    with pytest.warns(RuntimeWarning, match="LOOPBACK"):
        res = run_emulated(_sum_ranks, 2, bandwidth="1gbit", fallback_loopback=True, timeout=60)
    assert res == [(3.0, "lo"), (3.0, "lo")]
    with pytest.raises(ClusterUnavailable, match="root"):
        run_emulated(_sum_ranks, 2, bandwidth="1gbit", timeout=60)


@pytest.mark.gloo
def test_loopback_is_the_one_null_network(monkeypatch):
    """``"loopback"`` gives the null network (no namespaces, no root needed), with the cluster's
    interface; a rate gives an EmulatedCluster; the label says when a fallback ran on loopback."""
    monkeypatch.setattr(C, "netns_unavailable_reason", lambda: "the emulated cluster needs root (fake)")
    net = C.open_network("loopback", 2)
    assert isinstance(net, C.Loopback) and not net.emulated and net.bandwidth is None
    with net as cl:
        assert cl.placement(1) == {"GLOO_SOCKET_IFNAME": "lo"} and "loopback" in repr(cl)
        assert ss.run_local(_sum_ranks, 2, backend="gloo", placement=cl.placement, timeout=60) == [(3.0, "lo")] * 2
    assert C.network_label("loopback", net) == "loopback"
    em = C.open_network("1gbit", 2, fallback_loopback=True)
    assert isinstance(em, EmulatedCluster) and em.bandwidth == 10**9
    with pytest.warns(RuntimeWarning, match="LOOPBACK"), em:
        assert C.network_label("1gbit", em) == "1gbit->loopback"


@pytest.mark.gloo
def test_signal_handlers_are_restored(needs_netns):
    """The cluster and run_local replace SIGINT/SIGTERM handlers only while they run."""
    def mine(signum, frame):
        pass

    prev = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in prev:
            signal.signal(s, mine)
        with EmulatedCluster(2) as cl:
            assert signal.getsignal(signal.SIGTERM) is C._on_signal  # deletes the namespaces, then chains
            ss.run_local(_sum_ranks, 2, backend="gloo", placement=cl.placement, timeout=60)
            assert signal.getsignal(signal.SIGTERM) is C._on_signal
        assert all(signal.getsignal(s) is mine for s in prev)
    finally:
        for s, h in prev.items():
            signal.signal(s, h)


def _sum_ranks(comm):
    return float(comm.allreduce(torch.tensor([comm.rank + 1.0]))[0]), os.environ["GLOO_SOCKET_IFNAME"]


@pytest.mark.gloo
def test_cli_smoke(needs_netns, capsys):
    from sparsync.cli import main

    assert main(["cluster", "smoke", "--workers", "2", "--bandwidth", "100mbit", "--numel", "2e4",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "correct" in out and "model at 100mbit" in out and "default" not in out


def test_parse_bandwidth():
    assert C.parse_bandwidth("1gbit") == 10**9
    assert C.parse_bandwidth("100mbit") == 10**8
    assert C.parse_bandwidth("12.5MB/s") == 10**8
    assert C.parse_bandwidth(None) is None and C.parse_bandwidth("none") is None
    assert C.parse_bandwidth(2e9) == 2 * 10**9
    for bad in ("fast", "1gbitz", "-1gbit", "1bit", "1gbps"):
        with pytest.raises(ValueError, match="bandwidth"):
            C.parse_bandwidth(bad)
    assert C.format_bandwidth(10**9) == "1gbit" and C.format_bandwidth(None) == "unlimited"


_CHAINED = textwrap.dedent("""
    import os, signal
    from sparsync.cluster import EmulatedCluster, list_namespaces
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    cl = EmulatedCluster(2).start()
    base = cl.base
    os.kill(os.getpid(), signal.SIGTERM)  # the cluster's handler: delete the namespaces, then call ours
    left = [n for n in list_namespaces() if n.startswith(base)]
    print(seen == [signal.SIGTERM], left, signal.getsignal(signal.SIGTERM).__name__, flush=True)
""")


def test_signal_chains_to_the_previous_python_handler(needs_netns):
    """A signal that arrives while a network is open deletes its namespaces and is then handed to the
    handler that was installed before (which here keeps the process alive), and that handler is back."""
    out = subprocess.run([sys.executable, "-c", _CHAINED], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "[]", "<lambda>"]
