"""``sparsync bench gather-routes``: gloo's ring all-gather vs one batch of direct messages."""

import pytest
import torch

import sparsync as ss
from sparsync.bench.gather_routes import gather_routes_worker, run_gather_routes


def test_both_routes_gather_the_same_bytes_on_threads():
    res = ss.run_local(gather_routes_worker, 3, [1, 1000], 2, 1, backend="thread")
    for r in res:
        assert sorted(r) == [1, 1000]
        assert all(len(r[s]["ring"]) == 2 and len(r[s]["direct"]) == 2 for s in r)


def test_direct_route_is_the_rank_order_gather():
    def body(comm):
        t = torch.full((5,), comm.rank, dtype=torch.uint8)
        return [x.tolist() for x in comm._allgather_direct(t)], [x.tolist() for x in comm._allgather(t)]

    for direct, ring in ss.run_local(body, 4, backend="thread"):
        assert direct == ring == [[q] * 5 for q in range(4)]


@pytest.mark.gloo
def test_gather_routes_rows_on_gloo():
    rows = run_gather_routes(2, [8, 5000], calls=2, warmup=1)
    assert [r["bytes"] for r in rows] == [8, 5000]
    for r in rows:
        assert r["world_size"] == 2 and r["ring_s"] > 0 and r["direct_s"] > 0
        assert r["ratio"] == pytest.approx(r["direct_s"] / r["ring_s"])
