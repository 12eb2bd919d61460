"""SparseDDP as a well-behaved nn.Module: state-dict keys and round trips (plain, nested in a
parent module, under torch.compile), torch DDP's arguments, exports, no graph break under torch.compile,
and the asynchronous torch-DDP hook (same parameters as the synchronous path, state saved like PowerSGD's)."""

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import sparsync as ss


def _model(seed):
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


class _Parent(nn.Module):
    def __init__(self, ddp):
        super().__init__()
        self.head = nn.Linear(3, 3, bias=False)
        self.ddp = ddp

    def forward(self, x):
        return self.ddp(x)


def _same(a, b, what=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert set(a) == set(b), (what, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _train(ddp, fwd, comm, steps, start=0):
    opt = torch.optim.SGD(ddp.module.parameters(), lr=0.1)
    for s in range(start, start + steps):
        x, y = _data(comm.rank, s)
        opt.zero_grad()
        nn.functional.mse_loss(fwd(x), y).backward()
        opt.step()


def _round_trip(comm, wrap):
    """3 steps, save, 3 more steps; a fresh wrapper (other init) loaded from the save repeats them bitwise."""
    def build(seed):
        ddp = ss.SparseDDP(_model(seed), comm, reducer="topka", density=0.3, merge="wfbp")
        return ddp, wrap(ddp)

    ddp, outer = build(comm.rank)
    _train(ddp, outer, comm, 3)
    saved = copy.deepcopy(outer.state_dict())
    _train(ddp, outer, comm, 3, start=3)
    ddp2, outer2 = build(comm.rank + 7)
    outer2.load_state_dict(saved)
    _train(ddp2, outer2, comm, 3, start=3)
    _same(outer2.state_dict(), outer.state_dict(), "after resume")
    bare = _model(99)  # the model's own keys load into the bare model via ddp.module
    bare.load_state_dict(ddp.module.state_dict())
    assert torch.equal(_flat(bare), _flat(ddp.module))
    ddp.close()
    ddp2.close()
    return sorted(saved), saved


def test_state_dict_keys_and_round_trip_plain_and_nested():
    res = ss.run_local(_round_trip, 2, lambda d: d, backend="thread", timeout=60)
    keys, saved = res[0]
    assert "module.0.weight" in keys and "module.1.running_mean" in keys and "_extra_state" in keys
    assert all(k.startswith("module.") or k == "_extra_state" for k in keys)
    extra = saved["_extra_state"]
    assert extra["steps_done"] == 3 and all(r["residual"] is not None for r in extra["reducers"])
    res = ss.run_local(_round_trip, 2, _Parent, backend="thread", timeout=60)
    keys = res[0][0]
    assert "ddp.module.0.weight" in keys and "ddp._extra_state" in keys and "head.weight" in keys
    # prefix / destination / keep_vars are honoured like any nn.Module
    ddp = ss.run_local(lambda c: ss.SparseDDP(_model(0), c), 1, backend="thread")[0]
    dest = {}
    out = ddp.state_dict(destination=dest, prefix="x.", keep_vars=True)
    assert out is dest and "x.module.0.weight" in dest and isinstance(dest["x.module.0.weight"], nn.Parameter)
    assert "x._extra_state" in dest
    ddp.close()


def test_legacy_state_layout_loads():
    def fn(comm):
        ddp = ss.SparseDDP(_model(0), comm, reducer="topka", density=0.3)
        _train(ddp, ddp, comm, 2)
        legacy = {"module": ddp.module.state_dict(), "sparsync": ddp.sparsync_state_dict()}
        ddp2 = ss.SparseDDP(_model(5), comm, reducer="topka", density=0.3)
        ddp2.load_state_dict(legacy)
        _same(ddp2.state_dict(), ddp.state_dict())
        with pytest.raises(ValueError, match="sparsync_state_dict"):
            ddp2.load_sparsync_state_dict({"x": 1})
        return True

    assert ss.run_local(fn, 2, backend="thread", timeout=30) == [True, True]


def _compiled(comm):
    """torch.compile(SparseDDP): no graph break, no dynamo warning, keys _orig_mod.module.*, resume bitwise."""
    ex = torch._dynamo.explain(ss.SparseDDP(_model(0), comm))(torch.randn(8, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys, saved = _round_trip(comm, lambda d: torch.compile(d, backend="eager"))
    dyn = [str(w.message)[:120] for w in caught if "dynamo" in str(w.filename) or "Dynamo" in str(w.message)]
    return ex.graph_break_count, dyn, keys


@pytest.mark.gloo
def test_state_dict_round_trip_compiled_gloo():
    res = ss.run_local(_compiled, 2, backend="gloo", timeout=180)
    for breaks, dyn, keys in res:
        assert breaks == 0 and dyn == []
        assert "_orig_mod.module.0.weight" in keys and "_orig_mod._extra_state" in keys


def test_ddp_arguments_honoured_or_rejected():
    def fn(comm):
        m = _model(0)
        ok = ss.SparseDDP(m, comm, device_ids=None, output_device=None, find_unused_parameters=True,
                          static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=1, broadcast_buffers=False)
        assert ok.engine.merge == "buckets:1"
        ok.close()
        ss.SparseDDP(m, comm, device_ids=["cpu"], output_device="cpu").close()
        for kw, exc, match in [({"device_ids": [0, 1]}, ValueError, "one device"),
                               ({"device_ids": ["cuda:0"]}, ValueError, "move it first"),
                               ({"output_device": "cuda:1"}, ValueError, "does not move"),
                               ({"mixed_precision": object()}, TypeError, "mixed_precision"),
                               ({"dim": 1}, ValueError, "dim"),
                               ({"merge": "single", "bucket_cap_mb": 5}, ValueError, "bucket_cap_mb")]:
            with pytest.raises(exc, match=match):
                ss.SparseDDP(m, comm, **kw)
        d = ss.SparseDDP(m, comm)
        with pytest.raises(NotImplementedError, match="agree_steps"):
            d.join()
        d.close()
        # gradient_as_bucket_view=False: fresh gradient tensors every step
        d = ss.SparseDDP(m, comm, gradient_as_bucket_view=False)
        ptrs = []
        for s in range(2):
            x, y = _data(comm.rank, s)
            nn.functional.mse_loss(d(x), y).backward()
            ptrs.append(m[0].weight.grad.data_ptr())
            m.zero_grad()
        d.close()
        return ss.ddp.agree_steps(10 + comm.rank, comm), ptrs[0] != ptrs[1]

    res = ss.run_local(fn, 3, backend="thread", timeout=60)
    assert [r[0] for r in res] == [10, 10, 10] and all(r[1] for r in res)


def test_exports():
    assert {"SparseDDP", "ddp_hook", "DDPHook"} <= set(dir(ss)) and {"SparseDDP", "ddp_hook"} <= set(ss.__all__)


# ---------------------------------------------------------------------- torch DDP hook
def _hook_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 3))


def _hook_run(comm, asynchronous, steps=20, cap=0.01):
    # cap 0.01 MB: DDP's first iteration has one bucket, later ones two (its rebuild in ready order)
    ddp = nn.parallel.DistributedDataParallel(_hook_model(3), bucket_cap_mb=cap)
    hook = ss.ddp_hook("topka", density=0.25, module=ddp, asynchronous=asynchronous)
    ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        x, y = _data(comm.rank, s)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return ddp, hook, opt


def _hook_suite(comm):
    a_ddp, a_hook, _ = _hook_run(comm, True)
    s_ddp, _, _ = _hook_run(comm, False)
    assert a_hook._worker is not None and len(a_hook.reducers) > 1
    # PowerSGD-style save: pickle the hook (no process group, thread or module inside), 10 + 10 steps;
    # bitwise although the fresh DDP's first iteration has one bucket where the saved state has two
    ddp, hook, opt = _hook_run(comm, True, steps=10)
    buf = io.BytesIO()
    torch.save({"hook": hook, "model": ddp.module.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=False)
    ddp2 = nn.parallel.DistributedDataParallel(_hook_model(11), bucket_cap_mb=0.01)
    ddp2.module.load_state_dict(blob["model"])
    hook2 = blob["hook"]
    assert hook2.comm is None and hook2.module is None
    assert len(hook2.state_dict()["buckets"]) == 2
    ddp2.register_comm_hook(ddp2, hook2)
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.1)
    opt2.load_state_dict(blob["opt"])
    for s in range(10, 20):
        x, y = _data(comm.rank, s)
        for m, o in ((ddp, opt), (ddp2, opt2)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    return _flat(a_ddp.module), _flat(s_ddp.module), _flat(ddp.module), _flat(ddp2.module)


@pytest.mark.gloo
@pytest.mark.parametrize("P", [2, 3, 4])
def test_async_hook_matches_sync_and_resumes(P):
    res = ss.run_local(_hook_suite, P, backend="gloo", timeout=180)
    for r, (a, s, straight, resumed) in enumerate(res):
        assert torch.equal(a, s), f"rank {r}: async hook differs from the synchronous path after 20 steps"
        assert torch.equal(a, res[0][0]), f"rank {r}: parameters differ from rank 0"
        assert torch.equal(straight, resumed), f"rank {r}: pickled hook state did not resume bitwise"
    assert not torch.equal(res[0][0], _flat(_hook_model(3)))  # training moved the parameters
