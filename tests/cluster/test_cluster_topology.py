"""Sites in the emulated cluster (``EmulatedCluster(topology=...)``): the shaped links are where the layout
says (rates read back from tc), ranks reach each other across sites, the layout reaches the ranks, a rate
changes mid-run (from the launcher and from a rank), and bad options are refused in one line before
anything is created."""

import os

import pytest
import torch
from test_cluster_netns import _ours

import sparsync as ss
from sparsync.cli import main
from sparsync.cluster import EmulatedCluster, change_rate, parse_rate_schedule
from sparsync.sites import Topology

M, G = 10**6, 10**9


def _rank(comm):
    x = torch.full((1000,), float(comm.rank + 1))
    out = comm.allreduce(x)
    P = comm.world_size
    return {"ok": bool(torch.all(out == P * (P + 1) / 2)), "sites": os.environ.get("SPARSYNC_SITES"),
            "layout": ss.site_layout(P)}


def _rank_changes_rate(comm):
    change_rate(comm, "50mbit")
    return comm.allreduce(torch.ones(10))[0].item()


@pytest.mark.netns
def test_sites_links_rates_and_changes(needs_netns):
    with EmulatedCluster(4, topology=Topology.parse("2x2", "1gbit", "100mbit")) as cl:
        base = cl.base
        names = {n[len(base):] for n in _ours(base)}
        assert names == {"br", "b0", "b1", "r0", "r1", "r2", "r3"}
        rates = cl.rates()
        hosts = {f"r{r}:eth0" for r in range(4)} | {"b0:v0", "b0:v1", "b1:v2", "b1:v3"}
        uplinks = {"b0:wan", "br:s0", "b1:wan", "br:s1"}
        assert set(rates) == hosts | uplinks
        assert all(rates[k] == G for k in hosts) and all(rates[k] == 100 * M for k in uplinks)
        # rank 0's port is on site 0's bridge, rank 2's on site 1's
        assert "master br0" in cl.ns_exec("b0", "ip", "-o", "link", "show", "v0")
        assert "master br0" in cl.ns_exec("b1", "ip", "-o", "link", "show", "v2")
        res = ss.run_local(_rank, 4, backend="gloo", placement=cl.placement, timeout=60)
        assert all(r["ok"] for r in res)
        assert all(r["sites"] == "0,1;2,3" and r["layout"] == [[0, 1], [2, 3]] for r in res)
        # a rate change from the launcher: only the named links change
        cl.set_rate("inter", "10mbit")
        after = cl.rates()
        assert all(after[k] == 10 * M for k in uplinks) and all(after[k] == G for k in hosts)
        cl.set_rate("site1", None)
        after = cl.rates("inter")
        assert after["b1:wan"] is None and after["br:s1"] is None and after["b0:wan"] == 10 * M
        cl.set_rate(3, "200mbit")
        assert cl.rates(3) == {"r3:eth0": 200 * M, "b1:v3": 200 * M}
        # ... and from a rank, mid-run (what `sparsync train --rate-schedule` does)
        assert ss.run_local(_rank_changes_rate, 4, backend="gloo", placement=cl.placement, timeout=60)[0] == 4
        assert set(cl.rates("inter").values()) == {50 * M}
        with pytest.raises(ValueError, match="unknown link"):
            cl.set_rate("site7", "1gbit")
    assert not _ours(base)


def test_bad_topologies_refused_before_anything_is_created():
    with pytest.raises(ValueError, match="has 6 ranks, not world_size=4"):
        EmulatedCluster(4, topology="2x3@1gbit/100mbit")
    with pytest.raises(ValueError, match="not both"):
        EmulatedCluster(4, bandwidth="1gbit", topology="2x2@1gbit/100mbit")
    with pytest.raises(ValueError, match="SITESxRANKS"):
        Topology.parse("2by2", "1gbit", "1mbit")
    with pytest.raises(ValueError, match="needs both"):
        Topology.parse("2x2", "1gbit", None)
    assert Topology.from_spec("2x2@10000mbit/200mbit").spec() == "2x2@10gbit/200mbit"
    assert parse_rate_schedule("50:100mbit, 80:none") == {50: 100 * M, 80: None}
    for bad in ("50", "x:1gbit", "-1:1gbit", "5:1gbit,5:2gbit", "5:fast"):
        with pytest.raises(ValueError, match="rate-schedule|bandwidth"):
            parse_rate_schedule(bad)


@pytest.mark.parametrize("argv,words", [
    (["train", "--topology", "2x2", "--intra", "1gbit"], "needs both --intra"),
    (["train", "--topology", "2x3", "--intra", "1gbit", "--inter", "1mbit"], "has 6 ranks but --workers is 4"),
    (["train", "--inter", "1mbit"], "without one use --bandwidth"),
    (["train", "--rate-schedule", "3:1mbit"], "the network here is 'loopback'"),
    (["compare", "--topology", "2x2", "--intra", "1gbit", "--inter", "1mbat"], "bad bandwidth"),
    (["bench", "reducers", "--topology", "2x2", "--intra", "1gbit", "--inter", "1mbit", "--workers", "8"],
     "has 4 ranks but --workers asks for 8"),
    (["cluster", "smoke", "--topology", "3y1", "--intra", "1gbit", "--inter", "1mbit"], "SITESxRANKS"),
])
def test_cli_topology_errors_are_one_line(tmp_path, capsys, argv, words):
    code = main([*argv, "--runs-dir", str(tmp_path / "runs")] if argv[0] in ("train", "compare") else argv)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("note:")]
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "runs").exists()
