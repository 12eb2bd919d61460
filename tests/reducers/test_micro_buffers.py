"""Recycled output buffers (``Reducer.zeros_output``, used by ``micro`` with ``reuse_buffers=True``):
a buffer is reused only once nothing outside the reducer references it, and the results are bitwise
those of fresh allocations whether or not the caller keeps, mutates or views earlier outputs."""

import torch

import sparsync as ss
from sparsync.reducers.base import Reducer


class _Bare(Reducer):
    name = "bare"


def _bare():
    return _Bare.__new__(_Bare)


def test_zeros_output_recycles_only_unreferenced_buffers():
    r = _bare()
    a = r.zeros_output(16, torch.float32, "cpu")
    assert torch.equal(a, torch.zeros(16)) and a.dim() == 1
    pa = a.data_ptr()
    a.fill_(7.0)  # the caller mutates the output in place, then drops it
    b = r.zeros_output(16, torch.float32, "cpu")
    assert b.data_ptr() != pa  # a is still alive: never reused
    del a
    c = r.zeros_output(16, torch.float32, "cpu")
    assert c.data_ptr() == pa and torch.equal(c, torch.zeros(16))  # reused and wiped
    view = c[3:9]  # a view keeps the storage alive
    pc, pb = c.data_ptr(), b.data_ptr()
    del c, b
    d = r.zeros_output(16, torch.float32, "cpu")
    assert d.data_ptr() == pb  # c's buffer is still referenced through the view
    arr = d.numpy()  # a numpy alias counts too
    pd = d.data_ptr()
    del d
    e = r.zeros_output(16, torch.float32, "cpu")
    assert e.data_ptr() not in (pc, pd)
    assert float(arr.sum()) == 0.0 and float(view.sum()) == 0.0
    # other shape / dtype: a fresh tensor, pool bounded
    f = r.zeros_output(8, torch.float64, "cpu")
    assert f.dtype == torch.float64 and f.numel() == 8
    assert len(r._output_pool) <= r.output_pool_size


def test_large_recycled_outputs_are_wiped_by_the_streaming_fill():
    # from STREAM_MIN_BYTES on a recycled buffer is zeroed by the C kernel (sparsync.native.zero_)
    from sparsync.recycle import STREAM_MIN_BYTES

    n = STREAM_MIN_BYTES // 4 + 13
    r = _bare()
    for dtype in (torch.float32, torch.float64):
        a = r.zeros_output(n, dtype, "cpu")
        pa = a.data_ptr()
        a.fill_(-3.0)
        del a
        b = r.zeros_output(n, dtype, "cpu")
        assert b.data_ptr() == pa and int(torch.count_nonzero(b)) == 0 and not bool(b.signbit().any())
        del b


def test_zeros_output_pool_disabled():
    r = _bare()
    r.output_pool_size = 0
    a = r.zeros_output(16, torch.float32, "cpu")
    a.fill_(1.0)
    del a
    assert r._output_pool == []  # nothing kept: every call allocates
    assert torch.equal(r.zeros_output(16, torch.float32, "cpu"), torch.zeros(16))


def test_micro_outputs_identical_with_and_without_recycling():
    """Held, dropped and mutated outputs: every output equals the fresh-allocation reducer's."""

    def fn(comm):
        n, steps = 5003, 12
        fast = ss.make_reducer("micro", comm, density=0.02)
        slow = ss.make_reducer("micro", comm, density=0.02, reuse_buffers=False)
        held, ptrs, ok = [], set(), True
        for t in range(steps):
            g = torch.Generator().manual_seed(100 * comm.rank + t)
            x = torch.randn(n, generator=g) * (1 + t % 3)
            out = fast.reduce(x)
            ref = slow.reduce(x)
            ok &= torch.equal(out, ref)
            ptrs.add(out.data_ptr())
            if t % 3 == 0:
                held.append((out, ref))  # the caller keeps some outputs ...
            else:
                out.mul_(-3.0)  # ... and scribbles over the others before dropping them
            del out
        # kept outputs were never recycled underneath the caller
        ok &= all(torch.equal(o, r) for o, r in held)
        # recycling happened (fewer distinct buffers than steps), and ranks agree bitwise
        digest = [float(o.double().sum()) for o, _ in held]
        return ok, len(ptrs) < steps, digest, torch.equal(fast.residual, slow.residual)

    res = ss.run_local(fn, 3)
    assert all(r[0] and r[1] and r[3] for r in res), [r[:2] for r in res]
    assert all(r[2] == res[0][2] for r in res)
