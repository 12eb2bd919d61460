"""SparseDDP on bad or unusual input: shape mismatch, unused parameters, NaN/Inf, sparse gradients,
no_sync, timeline, profiling switch (thread ranks; gloo where a real process group matters)."""

import json

import pytest
import torch
from torch import nn

import sparsync as ss


def _init(m, seed):
    """Deterministic init without the global RNG (thread ranks share it, so seeding it races)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _mlp(seed, width=16):
    return _init(nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)), seed)


def _data(rank, step, n=5):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _grads(m):
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def _reference_avg_grads(model_fn, P, step=0, loss_fn=None):
    """Average over ranks of the local gradients, computed serially (the DDP definition)."""
    gs = []
    for r in range(P):
        m = model_fn(0)
        x, y = _data(r, step)
        (loss_fn or (lambda m, x, y: nn.functional.mse_loss(m(x), y)))(m, x, y).backward()
        gs.append(_grads(m))
    return torch.stack(gs).sum(0) / P


def test_shape_mismatch_detected_at_construction():
    def fn(comm):
        ss.SparseDDP(_mlp(0, width=16 + (comm.rank == 2)), comm)

    with pytest.raises(ValueError, match=r"differs across ranks.*rank 2"):
        ss.run_local(fn, 3, backend="thread", timeout=20)

    def fn2(comm):
        m = _mlp(0) if comm.rank == 0 else nn.Sequential(_mlp(0), nn.Linear(3, 3))
        ss.SparseDDP(m, comm)

    with pytest.raises(ValueError, match="number of trainable parameters differs"):
        ss.run_local(fn2, 2, backend="thread", timeout=20)


@pytest.mark.gloo
def test_shape_mismatch_gloo():
    def fn(comm):
        ss.SparseDDP(_mlp(0, width=16 + comm.rank), comm)

    with pytest.raises(ValueError, match="differs across ranks"):
        ss.run_local(fn, 2, backend="gloo", timeout=30)


class _Branchy(nn.Module):
    """``extra`` is used only on ranks where ``use_extra`` is set (data-dependent unused parameters)."""

    def __init__(self, use_extra):
        super().__init__()
        self.body = nn.Linear(6, 3)
        self.extra = nn.Linear(3, 3)
        self.use_extra = use_extra
        _init(self, 0)

    def forward(self, x):
        h = self.body(x)
        return self.extra(h) if self.use_extra else h


def test_unused_parameters_zero_fill_no_hang():
    P = 3

    def fn(comm, merge):
        m = _Branchy(use_extra=comm.rank == 0)
        ddp = ss.SparseDDP(m, comm, merge=merge)
        x, y = _data(comm.rank, 0)
        nn.functional.mse_loss(ddp(x), y).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}, ddp.last_stats["unused"]

    ref = {}
    for r in range(P):
        m = _Branchy(use_extra=r == 0)
        x, y = _data(r, 0)
        nn.functional.mse_loss(m(x), y).backward()
        for n, p in m.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            ref[n] = ref.get(n, 0) + g / P
    for merge in ("single", "wfbp"):
        res = ss.run_local(fn, P, merge, backend="thread", timeout=30)
        assert res[0][1] == 0 and res[1][1] == 2  # rank 1 had two parameters without a gradient
        for grads, _ in res:
            for n, g in ref.items():
                assert torch.allclose(grads[n], g, atol=1e-7), n

    def strict(comm):
        m = _Branchy(use_extra=comm.rank == 0)
        ddp = ss.SparseDDP(m, comm, unused="error")
        x, y = _data(comm.rank, 0)
        nn.functional.mse_loss(ddp(x), y).backward()

    with pytest.raises(RuntimeError, match="received no gradient"):
        ss.run_local(strict, 2, backend="thread", timeout=30)


def _nan_run(comm, mode, reducer):
    m = _mlp(1)
    ddp = ss.SparseDDP(m, comm, reducer=reducer, density=0.3, merge="wfbp", nonfinite=mode)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    skipped = []
    for step in range(4):
        x, y = _data(comm.rank, step)
        if step == 2 and comm.rank == 1:
            x[0, 0] = float("nan")
        before = torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        after = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        skipped.append((ddp.last_stats["skipped"], torch.equal(before, after)))
    residuals_finite = all(r.residual is None or bool(torch.isfinite(r.residual).all()) for r in ddp.reducers)
    return skipped, residuals_finite, torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def test_nonfinite_error_and_skip():
    with pytest.raises(FloatingPointError, match=r"non-finite.*ranks \[1\]"):
        ss.run_local(_nan_run, 3, "error", "dense", backend="thread", timeout=30)
    for reducer in ("dense", "topka"):
        res = ss.run_local(_nan_run, 3, "skip", reducer, backend="thread", timeout=30)
        for skipped, finite, params in res:
            assert [s for s, _ in skipped] == [False, False, True, False]
            assert skipped[2][1]  # parameters unchanged by the skipped step, on every rank
            assert finite  # residuals never absorb NaN
            assert torch.isfinite(params).all() and torch.equal(params, res[0][2])


class _Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 4, sparse=True)
        self.out = nn.Linear(4, 1)
        _init(self, 3)

    def forward(self, idx):
        return self.out(self.emb(idx).mean(1))


def test_sparse_embedding_gradients_dense_path():
    P = 3

    def batch(r):
        g = torch.Generator().manual_seed(r)
        return torch.randint(0, 50, (6, 3), generator=g), torch.randn(6, 1, generator=g)

    def fn(comm):
        m = _Emb()
        ddp = ss.SparseDDP(m, comm, merge="single")
        x, y = batch(comm.rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        return {n: p.grad.to_dense() if p.grad.is_sparse else p.grad for n, p in m.named_parameters()}

    ref = {}
    for r in range(P):
        m = _Emb()
        x, y = batch(r)
        nn.functional.mse_loss(m(x), y).backward()
        for n, p in m.named_parameters():
            ref[n] = ref.get(n, 0) + p.grad.to_dense() / P
    for grads in ss.run_local(fn, P, backend="thread", timeout=30):
        for n, g in ref.items():
            assert torch.allclose(grads[n], g, atol=1e-7), n


def test_no_sync_accumulates_then_averages():
    P = 2

    def fn(comm):
        m = _mlp(2)
        ddp = ss.SparseDDP(m, comm, merge="wfbp")
        x, y = _data(comm.rank, 0)
        with ddp.no_sync():
            nn.functional.mse_loss(ddp(x), y).backward()
        x, y = _data(comm.rank, 1)
        nn.functional.mse_loss(ddp(x), y).backward()
        return _grads(m)

    ref = 0
    for r in range(P):
        m = _mlp(2)
        for s in (0, 1):
            x, y = _data(r, s)
            nn.functional.mse_loss(m(x), y).backward()
        ref = ref + _grads(m) / P
    for g in ss.run_local(fn, P, backend="thread", timeout=30):
        assert torch.allclose(g, ref, atol=1e-7)


def test_timeline_and_profiled_switch(tmp_path):
    path = str(tmp_path / "trace.json")

    def fn(comm):
        m = _mlp(4)
        ddp = ss.SparseDDP(m, comm, merge="optimal", profile_warmup=1, profile_steps=2, timeline=path,
                           cost_model=(1e-4, 1e-9))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        finals = []
        for step in range(5):
            x, y = _data(comm.rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            finals.append(ddp.last_stats["final_plan"])
        return finals, ddp.groups, ddp.predictions()

    res = ss.run_local(fn, 2, backend="thread", timeout=30)
    assert res[0][0] == [False, False, False, True, True]  # profiled steps 1-3, new plan from step 4
    assert res[0][1] == res[1][1]
    assert set(res[0][2]) == {"wfbp", "single", "buckets:25", "mgwfbp", "optimal"}
    pred = res[0][2]
    assert all(pred["optimal"]["iteration_s"] <= v["iteration_s"] + 1e-12 for v in pred.values())
    for r in range(2):
        with open(tmp_path / f"trace.rank{r}.json") as f:
            ev = json.load(f)["traceEvents"]
        rows = {e.get("tid") for e in ev}
        assert {"backward", "comm", "wait"} <= rows
        assert sum(e.get("tid") == "backward" for e in ev) == 5 * 4  # 4 tensors x 5 steps


def test_bad_arguments():
    def fn(comm, **kw):
        ss.SparseDDP(_mlp(0), comm, **kw)

    for kw, match in [({"reducer": "nope"}, "unknown reducer"), ({"merge": "greedy"}, "unknown merge"),
                      ({"nonfinite": "maybe"}, "nonfinite"), ({"density": 0.0}, "density"),
                      ({"reducer": "dense", "reducer_options": {"bogus": 1}}, "unknown options")]:
        with pytest.raises((ValueError, TypeError), match=match):
            ss.run_local(fn, 1, backend="thread", timeout=10, **kw)
    with pytest.raises(TypeError):
        ss.run_local(lambda comm: ss.SparseDDP(object(), comm), 1, backend="thread")


def test_sparse_path_reducers_keep_ranks_identical():
    """Reducers with ``sparse_input`` (``reduce_sparse``) get the embedding's COO gradient alone in its group."""
    from sparsync.reducers.registry import load_all

    names = [n for n, c in sorted(load_all().items()) if c.sparse_input]
    if not names:
        pytest.skip("no registered reducer has reduce_sparse yet")

    def fn(comm, name):
        m = _Emb()
        ddp = ss.SparseDDP(m, comm, reducer=name, density=0.5, merge="single")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + comm.rank)
            x, y = torch.randint(0, 50, (6, 3), generator=g), torch.randn(6, 1, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        assert ["emb.weight"] in ddp.groups
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    for name in names:
        res = ss.run_local(fn, 3, name, backend="thread", timeout=30)
        assert all(torch.equal(res[0], r) for r in res), name


def test_stats_match_ledger_and_ring_formula():
    P = 4

    def fn(comm):
        m = _mlp(5)
        ddp = ss.SparseDDP(m, comm, merge="wfbp")
        x, y = _data(comm.rank, 0)
        snap = comm.ledger.snapshot()
        nn.functional.mse_loss(ddp(x), y).backward()
        return comm.ledger.since(snap), ddp.last_stats, [p.numel() for p in m.parameters()]

    for cost, st, sizes in ss.run_local(fn, P, backend="thread", timeout=30):
        assert st["bytes_received"] == cost["bytes_received"] and st["bytes_sent"] == cost["bytes_sent"]
        assert st["bytes_received"] == sum(2 * (P - 1) * 4 * n // P for n in sizes)
        assert st["groups"] == len(sizes) and st["numel"] == sum(sizes) and st["selected"] == sum(sizes)


def test_plan_cli(capsys):
    from sparsync.cli import main

    assert main(["plan", "--model", "tower", "--workers", "4", "--steps", "2", "--merge", "mgwfbp"]) == 0
    out = capsys.readouterr().out
    for s in ("wfbp", "single", "buckets:25", "mgwfbp", "optimal", "groups of mgwfbp"):
        assert s in out
    assert main(["plan", "--model", "tower", "--steps", "2", "--a", "1e-3", "--b", "1e-9", "--json"]) == 0
    import json as _json

    d = _json.loads(capsys.readouterr().out)
    opt = d["strategies"]["optimal"]["iteration_s"]
    assert all(opt <= v["iteration_s"] + 1e-12 for v in d["strategies"].values())
    assert main(["plan", "--model", "nope"]) == 2
    assert main(["plan", "--model", "tower", "--a", "1e-3"]) == 2


def test_plan_ties_and_missing_formula(capsys):
    import json as _json

    from sparsync.cli import main

    # one given cost model for every reducer: identical predictions, all tied with the fastest
    assert main(["plan", "--model", "tower", "--steps", "2", "--reducers", "topka,micro,dense",
                 "--a", "1e-3", "--b", "1e-9", "--json"]) == 0
    assert all(x["tied_with_fastest"] for x in _json.loads(capsys.readouterr().out)["ranking"])
    # formulas on a slow link: dense is far behind (no tie); ps has no formula and says so; topka has one
    assert main(["plan", "--model", "tower", "--steps", "2", "--reducers", "dense,topka,ps",
                 "--bandwidth", "100mbit"]) == 0
    out = capsys.readouterr().out
    assert "ps: no alpha-beta formula" in out and "formula topka" in out
    assert main(["plan", "--model", "tower", "--steps", "2", "--reducers", "dense,topka",
                 "--bandwidth", "100mbit", "--json"]) == 0
    rank = {x["reducer"]: x["tied_with_fastest"] for x in _json.loads(capsys.readouterr().out)["ranking"]}
    assert rank == {"topka": True, "dense": False}


def test_sparse_path_nan_and_unused_embedding_no_hang():
    """A sparse-path parameter that is unused or non-finite on one rank still makes the same calls."""
    from sparsync.reducers.registry import load_all

    names = [n for n, c in sorted(load_all().items()) if c.sparse_input]
    if not names:
        pytest.skip("no registered reducer has reduce_sparse yet")

    def fn(comm, name):
        m = _Emb()
        ddp = ss.SparseDDP(m, comm, reducer=name, density=0.5, merge="single", nonfinite="skip")
        out = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + comm.rank)
            x, y = torch.randint(0, 50, (6, 3), generator=g), torch.randn(6, 1, generator=g)
            if step == 1 and comm.rank == 1:
                y[0] = float("inf")
            m.zero_grad()
            if step == 2 and comm.rank == 0:  # embedding unused on rank 0
                loss = nn.functional.mse_loss(m.out(torch.zeros(6, 4)), y)
                ddp.engine.mark_backward_start()
            else:
                loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            out.append((ddp.last_stats["skipped"], ddp.last_stats["unused"]))
        return out

    for name in names:
        res = ss.run_local(fn, 2, name, backend="thread", timeout=30)
        assert [s for s, _ in res[0]] == [False, True, False], name
        assert res[0][2][1] == 1 and res[1][2][1] == 0


def test_profiler_and_live_cost_model():
    from sparsync.schedule.costmodel import CostModel
    from sparsync.schedule.profiler import profile_module

    m = _mlp(6)
    x, y = _data(0, 0)
    prof, t_f = profile_module(m, lambda: nn.functional.mse_loss(m(x), y), steps=3, warmup=1)
    assert sorted(prof.order) == [0, 1, 2, 3] and prof.order[0] in (2, 3)  # last layer's grads come first
    assert len(prof.t_b) == 4 and all(t >= 0 for t in prof.t_b) and t_f > 0 and prof.steps == 3
    assert all(p.grad is None for p in m.parameters())

    def fn(comm):
        snap = comm.ledger.snapshot()
        cm = CostModel.measure(comm, "dense", 1.0, sizes=[4096, 65536, 1 << 20], reps=2)
        assert comm.ledger.since(snap)["bytes_sent"] == 0  # calibration is not recorded
        return cm.a, cm.b, cm.r2

    res = ss.run_local(fn, 3, backend="thread", timeout=60)
    assert all(r == res[0] for r in res)  # every rank holds the same model
    assert res[0][0] >= 0 and res[0][1] >= 0 and res[0][2] is not None
