"""SparseVec and the stream format: round trips, sums against dense, wire size, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsync as ss
from sparsync import sparse as sp
from sparsync.sparse import add_at, set_at


@st.composite
def sparse_vecs(draw, numel=None):
    n = numel if numel is not None else draw(st.integers(1, 300))
    k = draw(st.integers(0, n))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    vals = torch.randn(k, generator=g)
    vals[vals == 0] = 1.0
    return ss.SparseVec(idx, vals, n)


@settings(max_examples=150, deadline=None)
@given(sparse_vecs())
def test_dense_round_trip(sv):
    back = ss.SparseVec.from_dense(sv.to_dense())
    assert back == sv


@settings(max_examples=150, deadline=None)
@given(sparse_vecs())
def test_wire_round_trip_and_size(sv):
    buf = sp.encode(sv)
    assert buf.dtype == torch.uint8
    assert buf.numel() == sp.wire_nbytes(sv.nnz, sv.numel, sv.dtype)
    # never larger than the dense payload + header
    assert buf.numel() <= sp.HEADER_BYTES + 4 * sv.numel
    out = sp.decode(buf, sv.numel, sv.dtype)
    assert torch.equal(sp.as_dense(out), sv.to_dense())
    if sp.sparse_is_smaller(sv.nnz, sv.numel):
        assert isinstance(out, ss.SparseVec) and out == sv
    else:
        assert isinstance(out, torch.Tensor)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 200).flatmap(lambda n: st.tuples(sparse_vecs(n), sparse_vecs(n))))
def test_sums_against_dense(pair):
    a, b = pair
    ref = a.to_dense() + b.to_dense()
    assert torch.equal((a + b).to_dense(), ref)
    assert torch.equal(a + b.to_dense(), ref)
    s_ab, s_ba = sp.add(a, b), sp.add(b, a)
    assert torch.equal(sp.as_dense(s_ab), ref)
    assert torch.equal(sp.as_dense(s_ab), sp.as_dense(s_ba))  # bitwise symmetric
    # auto switch: dense exactly when the sparse upper bound is not smaller
    assert isinstance(s_ab, torch.Tensor) == (not sp.sparse_is_smaller(a.nnz + b.nnz, a.numel))
    assert torch.equal(sp.add(a.to_dense(), b), ref) and torch.equal(sp.add(a, b.to_dense()), ref)


def test_switch_rule_at_equality():
    # 4-byte indices and values: sparse is smaller only while nnz < numel / 2 (code rule ">=" -> dense)
    assert sp.sparse_is_smaller(49, 100)
    assert not sp.sparse_is_smaller(50, 100)
    assert sp.wire_nbytes(50, 100) == 8 + 400


def test_index_dtype_widths():
    assert sp.index_dtype_for(1000) == torch.int32
    assert sp.index_dtype_for(2**31) == torch.int64


def test_int64_indices_on_the_wire():
    n = 2**31 + 10  # decode without materialising: only sparse payload
    sv = ss.SparseVec(torch.tensor([0, 2**31 + 5]), torch.tensor([1.0, 2.0]), n)
    buf = sp.encode(sv)
    assert buf.numel() == 8 + 2 * (8 + 4)
    assert sp.decode(buf, n) == sv


def test_coalesce_sums_duplicates():
    sv = ss.SparseVec.coalesce(torch.tensor([5, 1, 5, 3]), torch.tensor([1.0, 2.0, 3.0, 4.0]), 8)
    assert sv.indices.tolist() == [1, 3, 5] and sv.values.tolist() == [2.0, 4.0, 4.0]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ss.SparseVec(torch.tensor([[1]]), torch.tensor([1.0]), 4), "1-D"),
        (lambda: ss.SparseVec(torch.tensor([2, 1]), torch.tensor([1.0, 1.0]), 4), "sorted"),
        (lambda: ss.SparseVec(torch.tensor([1, 1]), torch.tensor([1.0, 1.0]), 4), "sorted and unique"),
        (lambda: ss.SparseVec(torch.tensor([1, 4]), torch.tensor([1.0, 1.0]), 4), "out of range"),
        (lambda: ss.SparseVec(torch.tensor([-1]), torch.tensor([1.0]), 4), "out of range"),
        (lambda: ss.SparseVec(torch.tensor([1]), torch.tensor([1.0, 2.0]), 4), "1 indices but 2 values"),
        (lambda: ss.SparseVec(torch.tensor([1.0]), torch.tensor([1.0]), 4), "integers"),
        (lambda: ss.SparseVec.from_dense(torch.zeros(2, 2)), "1-D"),
        (lambda: ss.SparseVec.empty(4) + ss.SparseVec.empty(5), "numel mismatch"),
    ],
)
def test_bad_input_is_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_decode_rejects_truncated_buffers():
    buf = sp.encode(ss.SparseVec(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), 100))
    with pytest.raises(ValueError, match="bytes"):
        sp.decode(buf[:-1], 100)


@pytest.mark.parametrize("threads", [1, 2])
def test_add_at_and_set_at_equal_index_add_and_index_copy_bitwise(threads):
    """``add_at`` (scatter_add_) accumulates repeated indices in input order exactly as ``index_add_``
    does - the sums of SparDL's teams, gTopk and every rank-order sum depend on it - on heavy-tailed
    values where any other order changes the bits; ``set_at`` writes like ``index_copy_`` and casts."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(7)
        for n, k in ((10, 5000), (100_000, 300_000), (1_000_000, 20_000)):
            idx = torch.randint(0, n, (k,), generator=g)
            vals = torch.randn(k, generator=g) * torch.exp(4 * torch.randn(k, generator=g))
            base = torch.randn(n, generator=g)
            want = base.clone().index_add_(0, idx, vals)
            assert torch.equal(add_at(base.clone(), idx, vals), want)
            assert torch.equal(add_at(base.clone(), idx.to(torch.int32), vals), want)
            # order matters on these values: a reversed order gives other bits somewhere
            assert not torch.equal(base.clone().index_add_(0, idx.flip(0), vals.flip(0)), want)
            uniq = torch.randperm(n, generator=g)[: min(n, k)]
            v = torch.randn(uniq.numel(), generator=g)
            assert torch.equal(set_at(base.clone(), uniq, v), base.clone().index_copy_(0, uniq, v))
        half = set_at(torch.zeros(4), torch.tensor([2, 0]), torch.tensor([1.5, -2.0], dtype=torch.float16))
        assert half.dtype == torch.float32 and half.tolist() == [-2.0, 0.0, 1.5, 0.0]
    finally:
        torch.set_num_threads(old)
