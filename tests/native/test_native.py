"""The C compaction kernels (``sparsync.native``): the same indices as the torch reference on every
edge (thresholds between fp32 neighbours, NaN, inf, signed zeros, lengths around the 64-element
groups, a buffer too short for the count, several threads at once), and the torch kernels inside a
``switched_off`` block (where and how the library is loaded: ``test_native_loading.py``)."""

import threading

import pytest
import torch

from sparsync import native

pytestmark = pytest.mark.skipif(not native.enabled(), reason=f"C kernels not built: {native.info()['why']}")


def reference(x, t, base=0):
    return torch.nonzero(x.abs() >= t).squeeze(1) + base


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 127, 128, 129, 1000, 4096 + 37])
def test_compact_equals_torch_at_every_length(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    for t in (1e-30, 0.5, 1.0, 2.5, 10.0):
        assert torch.equal(native.compact_abs_ge(x, t), reference(x, t))
        assert torch.equal(native.compact_abs_ge(x, t, base=1000), reference(x, t, 1000))


def test_special_values_and_thresholds_between_fp32_neighbours():
    base = torch.tensor(1.0)
    up = torch.nextafter(base, torch.tensor(2.0))
    down = torch.nextafter(base, torch.tensor(0.0))
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, float(up), float(down),
                      -float(up), float(down) * -1, 3e-45, -3e-45] * 7, dtype=torch.float32)
    # thresholds as Python floats (doubles) between fp32 values: torch compares in fp32, so must we
    for t in (1.0, float(up), float(down), 1.0 + 1e-12, 1.0 - 1e-12, (1.0 + float(up)) / 2, 1e-45, 3e-45):
        assert torch.equal(native.compact_abs_ge(x, t), reference(x, t)), t


def test_short_buffer_takes_a_second_pass(monkeypatch):
    monkeypatch.setattr(native, "_FIRST_CAPACITY", 5)
    monkeypatch.setattr(native, "_local", threading.local())  # a fresh, short buffer for this thread
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    got = native.compact_abs_ge(x, 0.1)
    assert got.numel() > 9000 and torch.equal(got, reference(x, 0.1))
    X = x.view(100, 100)
    t = torch.linspace(0.05, 3.0, 100)
    want = torch.nonzero((X.abs() >= t[:, None]).view(-1)).squeeze(1)
    assert torch.equal(native.compact_rows_abs_ge(X, t), want)


def test_results_are_not_overwritten_by_the_next_call():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    first = native.compact_abs_ge(x, 1.0)
    keep = first.clone()
    native.compact_abs_ge(-x * 3, 0.1)
    assert torch.equal(first, keep)


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 63), (7, 64), (5, 65), (64, 129), (2, 5000)])
def test_rows_with_a_threshold_each(rows, cols):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    X = torch.randn(rows, cols, generator=g)
    X[0, 0] = float("nan")
    t = torch.rand(rows, generator=g) * 2 + 1e-3
    want = torch.nonzero((X.abs() >= t[:, None]).view(-1)).squeeze(1)
    assert torch.equal(native.compact_rows_abs_ge(X, t), want)


def test_threads_at_once_each_get_their_own_result():
    xs = [torch.randn(200_000, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    got, errors = [None] * 4, []

    def work(i):
        try:
            for _ in range(20):
                got[i] = native.compact_abs_ge(xs[i], 2.0 + i / 10)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for i in range(4):
        assert torch.equal(got[i], reference(xs[i], 2.0 + i / 10))


@pytest.mark.parametrize("n", [0, 1, 7, 5000])
def test_bucket_count_equals_torch_bucketize(n):
    g = torch.Generator().manual_seed(n + 5)
    v = torch.randn(n, generator=g).abs() * 3
    if n > 4:
        v[:5] = torch.tensor([float("nan"), float("inf"), 0.0, 1.0, 2.0])  # NaN, inf, below all, on edges
    edges = [torch.tensor([1.0, 2.0, 2.0, 2.0, 4.0]),  # repeated edges (low-precision windows)
             torch.tensor([0.5]), torch.linspace(0.1, 5.0, 65)]
    for e in edges:
        hist, bucket = native.bucket_count(v, e)
        want = torch.bucketize(v, e, right=True)
        assert torch.equal(bucket, want)
        assert torch.equal(hist, torch.bincount(want, minlength=e.numel() + 1))
    with pytest.raises(ValueError, match="sorted ascending"):
        native.bucket_count(v, torch.tensor([2.0, 1.0]))


def test_unsuitable_inputs_are_refused_with_a_reason():
    assert not native.usable(torch.randn(10, dtype=torch.float64))
    assert not native.usable(torch.randn(10, 2).t())
    with pytest.raises(ValueError, match="1-D contiguous fp32"):
        native.compact_abs_ge(torch.randn(10, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="one threshold per row"):
        native.compact_rows_abs_ge(torch.randn(3, 4), torch.ones(2))


def _fold_reference(u, r, g, m, nesterov):
    """The torch passes momentum_fold replaces (sparsync.convergence)."""
    if g is None:
        u.mul_(m)
        r.add_(u * m if nesterov else u)
    else:
        torch.add(g, u, alpha=m, out=u)
        r.add_(torch.add(g, u, alpha=m) if nesterov else u)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 1000, 4096 + 37])
def test_momentum_fold_is_bitwise_torchs_passes(n, nesterov):
    gen = torch.Generator().manual_seed(n)
    for g in (torch.randn(n, generator=gen) * 1e3, None):
        u, r = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
        if n >= 9:  # signed zeros, a product that rounds to zero, inf and NaN travel like torch's
            u[:4] = torch.tensor([-0.0, 1e-45, float("inf"), float("nan")])
            if g is not None:
                g[:4] = torch.tensor([0.0, -1e-45, 1.0, 2.0])
        want_u, want_r = u.clone(), r.clone()
        _fold_reference(want_u, want_r, g, 0.9, nesterov)
        native.momentum_fold(u, r, g, 0.9, nesterov)
        assert torch.equal(u.view(torch.int32), want_u.view(torch.int32))  # bits: -0.0 and NaN included
        assert torch.equal(r.view(torch.int32), want_r.view(torch.int32))


def test_momentum_fold_refuses_unsuitable_inputs():
    with pytest.raises(ValueError, match="one length"):
        native.momentum_fold(torch.zeros(4), torch.zeros(5), None, 0.9, False)
    with pytest.raises(ValueError, match="fp32"):
        native.momentum_fold(torch.zeros(4, dtype=torch.float64), torch.zeros(4), None, 0.9, False)


def _misaligned(n, shift, gen, scale=1.0):
    """A contiguous fp32 view starting ``shift`` elements into a fresh tensor: every alignment of the
    streaming-store kernels' head, body and tail is taken."""
    return (torch.randn(n + shift, generator=gen) * scale)[shift:]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 33, 1000, 4096 + 37])
def test_sum_check_is_torchs_add_and_finds_every_nonfinite(n):
    gen = torch.Generator().manual_seed(n)
    for shift in range(9):
        g, r = _misaligned(n, shift, gen, 1e3), _misaligned(n, (shift * 5) % 9, gen)
        out = _misaligned(n, (shift * 3) % 8, gen)
        if n >= 9:  # signed zeros: added; finite inputs whose sum overflows: added, and refused (the sum is checked)
            g[:4], r[:4] = torch.tensor([-0.0, 0.0, 3e38, -3e38]), torch.tensor([-0.0, -0.0, 3e38, -3e38])
        assert native.sum_check(out, r, g) == (n < 9)
        assert torch.equal(out.view(torch.int32), torch.add(g, r).view(torch.int32))  # bits, -0.0 included
        if n >= 9:
            r[2:4] = 0.0
            assert native.sum_check(out, r, g)  # the same finite g, a residual that does not overflow
        assert native.sum_check(out, None, g) and torch.equal(out.view(torch.int32), g.view(torch.int32))
        for pos in {0, n // 2, n - 1} if n else ():
            for bad in (float("nan"), float("inf"), -float("inf")):
                h = g.clone()
                h[pos] = bad
                before = r.clone()
                assert not native.sum_check(out, r, h) and not native.sum_check(out, None, h)
                assert torch.equal(r, before)  # only out is written


def test_sum_check_refuses_an_output_over_its_inputs():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="must not overlap"):
        native.sum_check(x, torch.randn(100), x)
    with pytest.raises(ValueError, match="must not overlap"):
        native.sum_check(x[:50], x[10:60], torch.randn(50))
    with pytest.raises(ValueError, match="one length"):
        native.sum_check(torch.empty(4), None, torch.randn(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 31, 33, 1000, 4096 + 37])
def test_zero_clears_every_byte_at_every_alignment(n, dtype):
    for shift in range(5):
        x = torch.full((n + shift + 5,), -1, dtype=dtype)
        native.zero_(x[shift:shift + n])
        kept = torch.cat([x[:shift], x[shift + n:]])
        assert torch.equal(kept, torch.full((shift + 5,), -1, dtype=dtype))  # nothing around it touched
        zeros = torch.zeros((n * x.element_size(),), dtype=torch.uint8)
        assert torch.equal(x[shift:shift + n].view(torch.uint8), zeros)


@pytest.mark.parametrize("n", [1, 9, 1000, 4133])
def test_take_clear_is_index_select_then_index_fill(n):
    gen = torch.Generator().manual_seed(n)
    for k in sorted({0, 1, n // 7, n}):
        x = torch.randn(n, generator=gen)
        x[0] = -0.0
        idx = torch.randperm(n, generator=gen)[:k].sort().values
        want_x, want_v = x.clone(), x.index_select(0, idx)
        want_x.index_fill_(0, idx, 0)
        got = native.take_clear(x, idx)
        assert torch.equal(got.view(torch.int32), want_v.view(torch.int32))  # -0.0 read as is
        assert torch.equal(x.view(torch.int32), want_x.view(torch.int32))  # cleared to +0.0


def test_take_clear_refuses_unsorted_repeated_or_outside_indices_untouched():
    x = torch.randn(100)
    keep = x.clone()
    for bad in ([5, 3], [3, 3], [1, 100], [-1, 4]):
        assert native.take_clear(x, torch.tensor(bad)) is None, bad
        assert torch.equal(x, keep)  # nothing written
    with pytest.raises(ValueError, match="int64 CPU indices"):
        native.take_clear(x, torch.tensor([1, 2], dtype=torch.int32))


def test_switched_off_block_runs_the_torch_kernels_and_restores():
    from sparsync.select.threshold import threshold_indices

    x = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    with native.switched_off():
        assert not native.enabled() and not native.usable(x)
        off = threshold_indices(x, 1.5)
    assert native.enabled()
    assert torch.equal(off, threshold_indices(x, 1.5))


def test_switched_off_blocks_of_two_threads_overlap_and_count():
    """Two threads' blocks that end in the other order they began leave the kernels on afterwards
    (a saved-and-restored global would leave them off), and while either is open every thread of
    the process runs the torch kernels (thread ranks included)."""
    first_in, second_in, first_out, main_checked = (threading.Event() for _ in range(4))
    seen = {}

    def first():
        with native.switched_off():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with native.switched_off():
            second_in.set()
            first_out.wait(10)
            seen["inside"] = native.enabled()  # the first block has ended, this one is still open
            main_checked.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for th in threads:
        th.start()
    first_in.wait(10)
    seen["main thread"] = native.enabled()  # a block of another thread is open
    main_checked.set()
    for th in threads:
        th.join()
    assert seen == {"inside": False, "main thread": False}
    assert native.enabled()


def test_switched_off_reaches_thread_ranks_started_inside_the_block():
    """The switch is process-wide on purpose: thread ranks started inside a block run the torch kernels."""
    import sparsync as ss

    with native.switched_off():
        inside = ss.run_local(lambda comm: native.enabled(), 3, backend="thread")
    assert inside == [False] * 3
    assert ss.run_local(lambda comm: native.enabled(), 3, backend="thread") == [True] * 3
    assert native.SWITCH.blocks == 0 and not native.SWITCH.off


def test_add_packed_is_the_torch_decode_and_index_add():
    """One message of 2 / 4 / 8-bit values with chunk-local indices (a short last chunk), added into
    a non-zero output: the same bits as ``decode_message`` + ``index_add_``; an index that falls
    outside is refused with nothing written."""
    from sparsync.select.quantise import decode_message, encode_message
    gen = torch.Generator().manual_seed(5)
    n, chunk, k = 1050, 100, 7
    full, rest = divmod(n, chunk)
    count = full * k + 4
    local = torch.cat([torch.randperm(chunk, generator=gen)[:k].sort().values for _ in range(full)]
                      + [torch.randperm(rest, generator=gen)[:4].sort().values])
    base = (torch.arange(count) // k).clamp(max=full) * chunk
    for bits in (2, 4, 8):
        msg, _ = encode_message(local, 7, torch.randn(count, generator=gen), bits)
        out = torch.randn(n, generator=gen)
        where, v = decode_message(msg, count, 7, bits)
        want = out.clone().index_add_(0, base + where, v)
        assert native.add_packed(out, msg, count, chunk, k, 7, bits)
        assert torch.equal(out, want)
    bad = torch.cat([local[:-1], torch.tensor([127])])  # the short chunk's last index past n
    msg, _ = encode_message(bad, 7, torch.randn(count, generator=gen), 2)
    out = torch.zeros(n)
    assert not native.add_packed(out, msg, count, chunk, k, 7, 2) and not out.any()
    with pytest.raises(ValueError, match="exact uint8 bytes"):
        native.add_packed(out, msg[:-1], count, chunk, k, 7, 2)


def test_chunked_topk_refuses_a_k_that_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        native.chunked_topk(torch.randn(250), 100, 5, 60)  # the short chunk has 50 entries
