"""The torch DDP comm hook on torch futures: a staged reducer (``dense``: one all-reduce) is posted
``async_op=True`` on the hook's group and its future chained with ``then``; it must give bitwise the
bucket results of the synchronous hook and of the FIFO-thread path, on every rank, with the same
ledger, and a failure (bad input, a collective that times out) must come back as an exception from
the future, not a hang. Real gloo process groups; the staged interface is also held on thread ranks."""

from __future__ import annotations

import datetime
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparsync as ss
from sparsync.reducers.registry import load_all, make_reducer
from sparsync.torchcomm import TorchComm


def _net(big=False):
    torch.manual_seed(0)
    width = 1024 if big else 32  # big: a 1.05M-element bucket, reduced in pieces (TorchComm.COPY_PIPELINE)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def _grads(m):
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()]).clone()


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g)


def _train(comm, mode, steps, big, options, reducer="dense"):
    """``mode``: futures (the staged path), thread (the FIFO thread), sync, plain (torch DDP, no hook)."""
    cap = 25 if big else 0.002  # small: several buckets, rebuilt after the first iteration
    model = nn.parallel.DistributedDataParallel(_net(big), bucket_cap_mb=cap)
    hook = None
    if mode != "plain":
        hook = ss.ddp_hook(reducer, module=model, asynchronous=mode != "sync", **options)
        if mode == "thread":
            hook._staged = False  # the FIFO-thread path every multi-collective reducer takes
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for s in range(steps):
        opt.zero_grad()
        model(_batch(comm.rank, s)).square().mean().backward()
        grads.append(_grads(model.module))
        opt.step()
    out = {"params": _flat(model.module), "grads": grads}
    if hook is not None:
        out["ledger"] = {k: v.as_dict() for k, v in hook.comm.ledger.phases.items()}
        out["bytes"] = {i: st["bytes_sent"] for i, st in hook.last_stats.items()}
        out["numel"] = {i: r.numel for i, r in hook.reducers.items()}
        out["worker"] = hook._worker is not None
        # the bucket is donated: dense reduces it in place, never into an output buffer of its own
        out["copied"] = any(r.__dict__.get("_output_pool") for r in hook.reducers.values())
        out["state"] = hook.state_dict()
        hook.close()
    return out


def _paths(comm, steps, big, options, reducer="dense", modes=("futures", "thread", "sync", "plain")):
    return {mode: _train(comm, mode, steps, big, options, reducer) for mode in modes}


@pytest.mark.gloo
def test_sparseloco_on_the_futures_path_is_bitwise_the_thread_and_sync_paths():
    """sparseloco is staged (one all-gather of equal-size messages): the hook posts it from the hook
    call, and the gradients, parameters and ledgers equal those of the FIFO-thread and synchronous paths."""
    options = {"density": 4 / 64, "chunk": 64, "value_bits": 2}
    for got in ss.run_local(_paths, 3, 4, False, options, "sparseloco", ("futures", "thread", "sync"),
                            backend="gloo", timeout=120):
        fut, thr, syn = got["futures"], got["thread"], got["sync"]
        assert not fut["worker"] and thr["worker"]
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(fut["grads"], thr["grads"], syn["grads"]))
        assert torch.equal(fut["params"], syn["params"]) and fut["ledger"] == syn["ledger"] == thr["ledger"]


@pytest.mark.gloo
@pytest.mark.parametrize("P,big,options", [(2, False, {}), (3, False, {"nonfinite": "ignore"}),
                                           (4, True, {}), (2, True, {"inplace": True}),
                                           (2, False, {"value_dtype": "fp16"}), (3, True, {"value_dtype": "fp16"})])
def test_futures_path_is_bitwise_the_thread_and_sync_paths(P, big, options):
    steps = 3 if big else 5
    half = options.get("value_dtype") == "fp16"  # torch's fp16_compress_hook: half the bytes, fp16 rounding
    res = ss.run_local(_paths, P, steps, big, options, backend="gloo", timeout=120)
    for r, got in enumerate(res):
        fut, thr, syn, plain = got["futures"], got["thread"], got["sync"], got["plain"]
        assert not fut["worker"] and thr["worker"], "the staged path started a thread, or the thread path did not"
        assert not (fut["copied"] or thr["copied"] or syn["copied"]), "a donated bucket was copied"
        for s in range(steps):
            assert torch.equal(fut["grads"][s], syn["grads"][s]), f"rank {r} step {s}: futures != synchronous"
            assert torch.equal(fut["grads"][s], thr["grads"][s]), f"rank {r} step {s}: futures != thread path"
            assert torch.equal(fut["grads"][s], res[0]["futures"]["grads"][s]), f"rank {r} step {s}: ranks differ"
            # the mean, not the sum: torch DDP's own all-reduce up to rounding (fp16 values: theirs)
            scale = float(plain["grads"][s].abs().max())
            tol = dict(rtol=2e-3, atol=1e-3 * scale) if half else dict(rtol=1e-5, atol=1e-7)
            assert torch.allclose(fut["grads"][s], plain["grads"][s], **tol), f"rank {r} step {s}"
        assert torch.equal(fut["params"], syn["params"])
        assert fut["ledger"] == syn["ledger"] == thr["ledger"], f"rank {r}: ledgers differ"
        assert fut["bytes"] == syn["bytes"] and all(b > 0 for b in fut["bytes"].values())
        value_bytes = 2 if half else 4  # the ring's 2(P-1)/P values per element, each of value_bytes
        assert all(abs(b - 2 * (P - 1) * fut["numel"][i] * value_bytes / P) <= 2 * P * value_bytes
                   for i, b in fut["bytes"].items()), (fut["bytes"], fut["numel"])
        steps_of = {i: b["state"]["step"] for i, b in fut["state"]["buckets"].items()}
        assert steps_of == {i: b["state"]["step"] for i, b in syn["state"]["buckets"].items()}
        assert steps_of and min(steps_of.values()) >= steps - 1  # (DDP's rebuild after step 1: new reducers)
    assert not torch.equal(res[0]["futures"]["params"], _flat(_net(big)))  # training moved the parameters


def _failures(comm):
    """Rank 0 feeds a NaN in step 1 (its reducer refuses before posting); rank 1's all-reduce, posted,
    then finds no peer and times out. Both must raise from backward (DDP waits on the hook's future)."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    lone = TorchComm(dist.new_group(timeout=datetime.timedelta(seconds=2)))  # every rank, before any error
    model = nn.parallel.DistributedDataParallel(_net())
    hook = ss.ddp_hook("dense", module=model)
    model.register_comm_hook(group, hook)
    errors = []
    for s in range(2):
        x = _batch(comm.rank, s)
        if s == 1 and comm.rank == 0:
            x[0, 0] = float("nan")
        try:
            model(x).square().mean().backward()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            errors.append((s, type(e).__name__, str(e)))
    # a pieced all-reduce (four works' futures collected) that no peer joins: the error of the combined future
    if comm.rank == 1:
        t = torch.ones(1 << 21)
        try:
            lone.allreduce_async(t, out=t, pieces=True).wait()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            errors.append(("pieces", type(e).__name__, str(e)))
    dist.barrier()
    return errors, hook._worker is None


@pytest.mark.gloo
def test_failure_comes_back_from_the_future():
    (e0, staged0), (e1, staged1) = ss.run_local(_failures, 2, backend="gloo", timeout=60)
    assert staged0 and staged1
    assert len(e0) == 1 and e0[0][0] == 1 and "non-finite gradient" in e0[0][2], e0
    assert len(e1) == 2 and e1[0][0] == 1 and re.search("timed? ?out", e1[0][2].lower()), e1  # gloo's wordings
    assert e1[1][0] == "pieces" and re.search("timed? ?out", e1[1][2].lower()), e1


# ---------------------------------------------------------------------- the staged interface on any Comm
def _start_vs_reduce(comm, name, options):
    g = torch.Generator().manual_seed(comm.rank)
    grads = [torch.randn(300, generator=g) for _ in range(3)]
    a, b = make_reducer(name, comm, **options), make_reducer(name, comm, **options)
    outs, done = [], []
    for x in grads:
        fut = a.start(x)
        done.append(fut.done())
        outs.append((fut.wait().clone(), b.reduce(x).clone()))
    same_residual = a.residual is None or torch.equal(a.residual, b.residual)
    refused = None
    try:
        make_reducer("topka", comm).start(grads[0])
    except TypeError as e:
        refused = str(e)
    return outs, done, a.step, a.stats["bytes_sent"] == b.stats["bytes_sent"] > 0, same_residual, refused


@pytest.mark.parametrize("name,options,backend", [
    ("dense", {}, "thread"),
    ("sparseloco", {"density": 4 / 64, "chunk": 64, "value_bits": 2}, "thread"),
    ("sparseloco", {"density": 4 / 64, "chunk": 64, "value_bits": 2}, "gloo"),
])
def test_start_equals_reduce(name, options, backend):
    """``start`` gives ``reduce``'s sum bit for bit, the same bytes and residual; thread ranks have no
    asynchronous collectives (completed at once); a reducer of several collectives refuses it."""
    for outs, done, step, same_bytes, same_residual, refused in ss.run_local(_start_vs_reduce, 3, name, options,
                                                                             backend=backend, timeout=60):
        assert all(torch.equal(x, y) for x, y in outs) and step == 3 and same_bytes and same_residual
        assert backend != "thread" or all(done)
        assert refused and "not staged" in refused


def test_staged_is_declared():
    staged = {name for name, cls in load_all().items() if cls.staged}
    assert {"dense", "sparseloco"} <= staged and "topka" not in staged and "micro" not in staged


def _resume(comm):
    """Straight 6 steps vs 3 + save (``weights_only``) + 3 on a fresh DDP and hook: bitwise. The fresh
    DDP's first iteration has its initial bucket layout, which the staged hook reduces in the saved
    buckets' parts, in order, inline; its later iterations take the futures path again."""
    import io

    def run(model, hook, start, stop):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for s in range(start, stop):
            opt.zero_grad()
            model(_batch(comm.rank, s)).square().mean().backward()
            with torch.no_grad():  # plain SGD without optimizer state: the parameters are the whole state
                opt.step()

    def fresh():
        model = nn.parallel.DistributedDataParallel(_net(), bucket_cap_mb=0.002)
        hook = ss.ddp_hook("dense", module=model)
        model.register_comm_hook(None, hook)
        return model, hook

    straight, _ = fresh()
    run(straight, None, 0, 6)
    first, hook = fresh()
    run(first, hook, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": first.module.state_dict(), "hook": hook.state_dict()}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    second, hook2 = fresh()
    second.module.load_state_dict(blob["model"])
    hook2.load_state_dict(blob["hook"])
    in_parts, by_parts = [], hook2._sum_saved_parts
    hook2._sum_saved_parts = lambda *a: in_parts.append(1) or by_parts(*a)  # count the inline part path
    run(second, hook2, 3, 6)
    return _flat(straight.module), _flat(second.module), len(in_parts) > 0, hook2._worker is None


@pytest.mark.gloo
def test_resume_through_saved_parts_is_bitwise():
    for r, (straight, resumed, in_parts, no_thread) in enumerate(ss.run_local(_resume, 2, backend="gloo",
                                                                               timeout=60)):
        assert in_parts and no_thread
        assert torch.equal(straight, resumed), f"rank {r}: the resumed run differs from the straight one"


def _half(comm):
    grads = {}
    for dtype in (torch.float16, torch.bfloat16):
        for asynchronous in (True, False):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)).to(dtype)
            model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)
            hook = ss.ddp_hook("dense", module=model, asynchronous=asynchronous)
            model.register_comm_hook(None, hook)
            model(_batch(comm.rank, 0).to(dtype)).float().square().mean().backward()
            grads[dtype, asynchronous] = _grads(net)
    return grads


@pytest.mark.gloo
def test_half_precision_buckets_on_futures():
    """DDP's buckets in the model's half-precision dtype: the staged path sums them as the synchronous one."""
    res = ss.run_local(_half, 2, backend="gloo", timeout=60)
    for r, grads in enumerate(res):
        for dtype in (torch.float16, torch.bfloat16):
            got = grads[dtype, True]
            assert got.dtype == dtype and torch.equal(got, grads[dtype, False]), f"rank {r} {dtype}"
            assert torch.equal(got, res[0][dtype, True]), f"rank {r} {dtype} differs from rank 0"
            assert got.abs().sum() > 0
