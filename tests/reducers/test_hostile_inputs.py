"""Hostile input: NaN/Inf through EVERY registered reducer raises with
the rank named and nothing absorbed into the residual; empty gradients, mixed dtypes / densities /
sizes across ranks and non-integer SparseVec sizes get messages naming the problem."""

import pytest
import torch

import sparsync as ss
from sparsync.reducers.registry import load_all, make_reducer
from sparsync.sparse import SparseVec

REDUCERS = sorted(load_all())
N = 4096


def _grad(rank, step, n=N, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g).to(dtype)


def _nonfinite_worker(comm, name, bad, bad_rank, policy):
    r = make_reducer(name, comm, 0.05, nonfinite=policy)
    r.reduce(_grad(comm.rank, 0))
    before = None if r.residual is None else r.residual.clone()
    g = _grad(comm.rank, 1)
    if comm.rank == bad_rank:
        g[7] = bad
    snap = comm.ledger.snapshot()
    try:
        r.reduce(g)
    except FloatingPointError:
        after = r.residual
        assert r.step == 1  # the failed call did not count
        assert (before is None and after is None) or torch.equal(before, after)  # nothing absorbed
        assert comm.ledger.since(snap)["bytes_sent"] == 0  # nothing sent
        raise
    return "returned"


@pytest.mark.parametrize("name", REDUCERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_raises_naming_the_rank_in_every_reducer(name, bad):
    with pytest.raises(FloatingPointError, match=r"rank 2: .*non-finite gradient at step 1") as ei:
        ss.run_local(_nonfinite_worker, 4, name, bad, 2, "error", backend="thread", timeout=60)
    assert "nonfinite='ignore'" in str(ei.value)


@pytest.mark.parametrize("name", ["spardl", "dense"])
def test_nonfinite_check_fused_into_the_first_pass_has_a_torch_twin(name):
    # spardl and dense check inside their first pass (Reducer.sum_checked): the C kernel by default
    # (above), torch's add and check without it - the same refusal, nothing sent or absorbed
    from sparsync import native

    with native.switched_off(), pytest.raises(FloatingPointError, match=r"rank 1: .*non-finite gradient at step 1"):
        ss.run_local(_nonfinite_worker, 4, name, float("nan"), 1, "error", backend="thread", timeout=60)


@pytest.mark.parametrize("name", ["micro", "oktopk", "gtopk", "hard_threshold", "topka"])
def test_nonfinite_ignore_is_an_explicit_opt_out(name):
    # the audit's silent case, now only on request: no check - every rank's call returns (these
    # reducers carry the NaN through rather than failing on it)
    out = ss.run_local(_nonfinite_worker, 4, name, float("nan"), 2, "ignore", backend="thread", timeout=60)
    assert out == ["returned"] * 4


def test_nonfinite_policy_is_validated():
    with pytest.raises(ValueError, match="nonfinite must be one of error, ignore"):
        ss.run_local(lambda c: make_reducer("micro", c, 0.05, nonfinite="skip"), 2, backend="thread")


def test_sum_based_check_has_no_false_positive_on_overflowing_sums():
    # finite values whose float32 sum overflows: the exact check must clear them (no raise), and the
    # reduction then returns what float32 gives for the sum of two ranks' 3e38: +inf at the k sent entries
    def w(comm):
        r = make_reducer("topka", comm, 0.05)
        x = torch.full((N,), 3e38)
        out = r.reduce(x)
        return out, r.residual

    k = round(0.05 * N)
    for out, residual in ss.run_local(w, 2, backend="thread"):
        sent = out != 0
        assert int(sent.sum()) == k
        assert torch.equal(out[sent], torch.full((k,), float("inf")))
        # what was not sent stays in the residual, finite and unchanged
        assert torch.equal(residual[~sent], torch.full((N - k,), 3e38)) and not residual[sent].any()


@pytest.mark.parametrize("name", ["spardl", "micro", "s2", "dense"])
def test_empty_gradient_is_a_clear_error(name):
    with pytest.raises(ValueError, match="non-empty gradient, got 0 elements"):
        ss.run_local(lambda c: make_reducer(name, c, 0.05).reduce(torch.zeros(0)), 2, backend="thread")


def _mixed(comm, name, what):
    dtype = torch.float64 if (what == "dtype" and comm.rank == 1) else torch.float32
    density = 0.1 if (what == "density" and comm.rank == 3) else 0.05
    n = N + 8 if (what == "numel" and comm.rank == 2) else N
    return make_reducer(name, comm, density).reduce(_grad(comm.rank, 0, n, dtype))


@pytest.mark.parametrize("name", ["micro", "spardl", "s2", "sparcml", "oktopk"])
@pytest.mark.parametrize("what,expect", [("dtype", "gradient dtype differs across ranks: rank 0: float32, rank 1: "
                                                   "float64"),
                                         ("density", "density differs across ranks: rank 0: 0.05, rank 1: 0.05, "
                                                     "rank 2: 0.05, rank 3: 0.1"),
                                         ("numel", f"gradient numel differs across ranks: rank 0: {N}, rank 1: {N}, "
                                                   f"rank 2: {N + 8}")])
def test_mismatch_across_ranks_is_named(name, what, expect):
    with pytest.raises(ValueError, match=expect):
        ss.run_local(_mixed, 4, name, what, backend="thread", timeout=60)


@pytest.mark.parametrize("numel", [2.7, 3.0, "3", True, None])
def test_sparsevec_numel_must_be_an_integer(numel):
    with pytest.raises(TypeError, match="numel must be an integer"):
        SparseVec(torch.tensor([0]), torch.tensor([1.0]), numel)
    assert SparseVec(torch.tensor([0]), torch.tensor([1.0]), torch.tensor(3)).numel == 3
