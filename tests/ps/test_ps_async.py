"""Asynchronous parameter server with bounded staleness (``sparsync.ps.async_ps``, ``train-linear
--algorithm ps-async``).

* the shard state machine under thousands of random interleavings (no communication): the staleness
  bound holds for every push, every push is applied exactly once (integer gradients, exact scales, so
  the order cannot matter), a worker's delta pulls reproduce the server's shard bitwise, early
  finishers never block the others, and s = 0 reads exactly version = step;
* real gloo processes: the same properties through the wire, s = 0 bitwise equal to the synchronous
  PS trainer, a silent worker makes the server fail with a timeout naming it and its step (no hang),
  bad options fail with one line.
"""

import multiprocessing
import time

import pytest
import torch

import sparsync as ss
from sparsync.ps import (PSClient, ShardState, StalenessViolation, check_async_servers, check_staleness, serve,
                         shard_bounds, transport_for)
from sparsync.sparse import SparseVec

LR = 12.0  # lr / b is an integer for every b in 1..4 running workers: every update is exact


def _grad(q: int, t: int, n: int) -> SparseVec:
    """Worker q's step-t gradient: small integers on a few indices (exact in float64 sums)."""
    g = torch.Generator().manual_seed(1000 * q + t)
    idx = torch.randperm(n, generator=g)[: 1 + (q + t) % 5].sort().values
    vals = torch.randint(-9, 10, (idx.numel(),), generator=g).to(torch.float64)
    return SparseVec(idx, vals, n)


def _expected(steps: list[int], n: int) -> torch.Tensor:
    """w after every push of every worker: - sum_t lr/b_t sum_q g_{q,t}, b_t = workers running at t."""
    w = torch.zeros(n, dtype=torch.float64)
    for t in range(max(steps)):
        running = [q for q in range(len(steps)) if steps[q] > t]
        for q in running:
            w -= LR / len(running) * _grad(q, t, n).to_dense()
    return w


def _simulate(steps: list[int], s: int, n: int, seed: int):
    """Random interleaving of W workers' pull / push / finish events on one ShardState."""
    W = len(steps)
    st = ShardState(n, W, s, LR, dtype=torch.float64)
    local = [torch.zeros(n, dtype=torch.float64) for _ in range(W)]
    have, read, pulled = [0] * W, [0] * W, [False] * W
    gen = torch.Generator().manual_seed(seed)
    live = [q for q in range(W) if steps[q] > 0]
    for q in range(W):
        if steps[q] == 0:
            st.finish(q)
    while live:
        movable = [q for q in live if pulled[q] or st.ready(max(0, st.clock[q] - s))]
        assert movable, f"deadlock: clocks {st.clock}, version {st.version}"
        q = movable[int(torch.randint(len(movable), (1,), generator=gen))]
        c = st.clock[q]
        if not pulled[q]:
            d = st.delta(have[q])
            if isinstance(d, SparseVec):
                local[q][d.indices] = d.values
            else:
                local[q].copy_(d)
            assert torch.equal(local[q], st.w), "a delta pull must reproduce the shard exactly"
            have[q] = read[q] = st.version
            assert c - s <= read[q] <= c
            pulled[q] = True
            continue
        st.push(q, c, read[q], 1, _grad(q, c, n))
        pulled[q] = False
        if st.clock[q] == steps[q]:
            st.finish(q)
            live.remove(q)
    return st


@pytest.mark.parametrize("s", [0, 1, 3])
def test_state_machine_random_interleavings(s):
    lags = set()
    for seed in range(60):
        steps = [[6, 6, 6], [6, 2, 6, 4], [3, 7], [5, 0, 5, 1]][seed % 4]
        st = _simulate(steps, s, 23, seed)
        assert st.done and st.version == max(steps)
        assert torch.equal(st.w, _expected(steps, 23))  # every push applied exactly once
        assert sorted((r.worker, r.step) for r in st.log) == sorted(
            (q, t) for q, k in enumerate(steps) for t in range(k))
        for r in st.log:
            assert r.step - r.read_version <= s and r.step - r.server_version <= s
            lags.add(r.step - r.read_version)
    assert max(lags) == s  # the bound is reached (workers did run ahead), never exceeded


def test_state_machine_rejects_protocol_violations():
    st = ShardState(5, 2, 1, LR, dtype=torch.float64)
    with pytest.raises(StalenessViolation, match="expected step 0"):
        st.push(0, 1, 0, 1, _grad(0, 0, 5))
    st.push(0, 0, 0, 1, _grad(0, 0, 5))
    st.push(0, 1, 0, 1, _grad(0, 1, 5))  # one ahead of worker 1: allowed with s = 1
    with pytest.raises(StalenessViolation, match="staleness bound 1"):
        st.push(0, 2, 0, 1, _grad(0, 2, 5))  # two ahead
    st.finish(0)
    with pytest.raises(StalenessViolation, match="after finishing"):
        st.push(0, 2, 1, 1, _grad(0, 2, 5))


def test_bad_options_one_line():
    with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
        check_staleness(-1)
    with pytest.raises(ValueError, match=r"servers must be an integer in \[1, 3\]"):
        check_async_servers(4, 4)
    with pytest.raises(ValueError, match="use backend 'gloo'"):
        ss.run_local(lambda c: transport_for(c, 1.0), 2)


# ---------------------------------------------------------------------- gloo processes
def _ps_run(comm, servers, s, steps, n, slow, timeout=20.0):
    """Servers serve; worker q pushes steps[q] integer gradients (worker `slow` sleeps each step)."""
    tr = transport_for(comm, timeout)
    if tr.rank < servers:
        st = serve(tr, n, servers, s, LR, dtype=torch.float64)
        return "server", st.w, st.log
    q = tr.rank - servers
    client = PSClient(tr, n, servers, s, torch.float64)
    seen = []
    for t in range(steps[q]):
        seen.append(client.pull())
        if q == slow:
            time.sleep(0.02)
        client.push(_grad(q, t, n), 1)
    return "worker", client.finish(), seen  # waits for the others, returns the final model


@pytest.mark.gloo
@pytest.mark.parametrize("servers,s,steps", [(1, 2, [8, 8, 3]), (2, 0, [6, 6]), (2, 3, [10, 2, 10])])
def test_gloo_bound_exactly_once_and_early_finish(servers, s, steps):
    n = 37  # shards of 19 and 18 with two servers
    res = ss.run_local(_ps_run, servers + len(steps), servers, s, steps, n, 0, backend="gloo", timeout=60)
    b = shard_bounds(n, servers)
    model = torch.cat([res[k][1] for k in range(servers)])
    assert torch.equal(model, _expected(steps, n))
    for q in range(len(steps)):
        assert torch.equal(res[servers + q][1], model), f"worker {q} must end with the final model"
    lags = []
    for k in range(servers):
        log = res[k][2]
        assert sorted((r.worker, r.step) for r in log) == sorted((q, t) for q, m in enumerate(steps) for t in range(m))
        assert all(r.step - r.read_version <= s and r.step - r.server_version <= s for r in log), (k, b)
        lags += [r.step - r.read_version for r in log]
    if s:
        assert max(lags) >= 1  # the fast workers ran ahead of the slow worker 0
    else:
        assert max(lags) == 0
    _assert_no_children()


def _silent_worker(comm):
    tr = transport_for(comm, 1.0)
    if tr.rank == 0:
        return serve(tr, 10, 1, 0, LR, dtype=torch.float64).version
    client = PSClient(tr, 10, 1, 0, torch.float64)
    client.pull()
    client.push(_grad(tr.rank - 1, 0, 10), 1)
    if tr.rank == 2:
        time.sleep(30)  # stuck: never pushes step 1
    client.pull()
    client.push(_grad(tr.rank - 1, 1, 10), 1)
    client.finish()


@pytest.mark.gloo
def test_gloo_silent_worker_times_out_naming_it():
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"worker 1 at step 1") as e:
        ss.run_local(_silent_worker, 3, backend="gloo", timeout=60)
    assert time.monotonic() - t0 < 20, "must fail by the receive timeout, not hang"
    assert "no message after 1 s" in str(e.value)
    _assert_no_children()


def _assert_no_children(wait_s: float = 5.0):
    """Every rank process is gone (no orphan left behind by a failed or finished run)."""
    end = time.monotonic() + wait_s
    while multiprocessing.active_children() and time.monotonic() < end:  # also reaps the exited ones
        time.sleep(0.05)
    assert not multiprocessing.active_children()


def _train(comm, alg, tr_ds, te_ds, **kw):
    from sparsync.linear import train

    return train(comm, tr_ds, "logreg", epochs=2, global_batch=100, lr=5.0, l2=1e-3, algorithm=alg,
                 test_ds=te_ds, **kw)


@pytest.mark.gloo
def test_gloo_staleness0_is_bitwise_the_sync_ps():
    from sparsync.linear import make_synthetic

    tr_ds, te_ds = make_synthetic(700, 3001, 10, seed=5).split(0.25, 0)
    sync = ss.run_local(_train, 3, "ps", tr_ds, te_ds, servers=2)
    res = ss.run_local(_train, 5, "ps-async", tr_ds, te_ds, servers=2, staleness=0, straggler_ms=5,
                       backend="gloo", timeout=60)  # a random slow worker per step changes timing, not bits
    for r in res[2:]:
        assert torch.equal(r["w"], sync[0]["w"])  # float32, with L2 shrink: the same bits
        assert [h["lag_max"] for h in r["history"]] == [0, 0]
    assert torch.equal(torch.cat([res[0]["w"], res[1]["w"]]), sync[0]["w"])
    assert res[2]["history"][-1]["loss"] == pytest.approx(sync[0]["history"][-1]["loss"], rel=1e-6)
    stale = ss.run_local(_train, 4, "ps-async", tr_ds, te_ds, servers=1, staleness=4, straggler_ms=20,
                         backend="gloo", timeout=60)
    assert all(torch.equal(r["w"], stale[1]["w"]) for r in stale[2:])
    lags = [r.step - r.read_version for r in stale[0]["pushes"]]
    assert max(lags) <= 4 and max(lags) >= 1  # the others ran ahead of each step's straggler


@pytest.mark.parametrize("argv,msg", [
    (["--servers", "4"], "--servers must be in [1, --workers - 1]"),
    (["--staleness", "-1"], "--staleness must be >= 0, got -1"),
    (["--ps-timeout", "0"], "--ps-timeout must be > 0"),
    (["--backend", "thread"], "use --backend gloo"),
    (["--straggler-ms", "-1"], "--straggler-ms must be >= 0"),
])
def test_cli_bad_options_one_line(capsys, argv, msg):
    from sparsync.cli import main

    assert main(["train-linear", "--workers", "4", "--algorithm", "ps-async", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


@pytest.mark.gloo
def test_cli_ps_async_runs(capsys):
    from sparsync.cli import main

    rc = main(["train-linear", "--samples", "1200", "--features", "4000", "--workers", "3", "--epochs", "2",
               "--algorithm", "ps-async", "--servers", "1", "--staleness", "2", "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0 and "staleness: mean" in out
    assert len([ln for ln in out.splitlines() if ln.strip().startswith(("1 ", "2 "))]) == 2
