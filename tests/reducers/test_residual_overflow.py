"""A finite gradient can overflow the error-feedback residual (``grad + residual`` past the float
range although ``grad`` is finite): the reducers' first pass checks the SUM, not the gradient alone,
so every reducer with a residual raises naming the residual - before anything is sent, residual
unchanged - with the C kernels and with the torch kernels alike (the ``kernel`` fixture)."""

import pytest
import torch

import sparsync as ss
from sparsync.reducers.registry import load_all, make_reducer

REDUCERS = sorted(load_all())
HUGE = 3e38  # finite in float32 (max 3.4e38); twice it is not


def _run(name, seen):
    def w(comm):
        r = make_reducer(name, comm, 0.05)
        for step in range(6):
            g = torch.randn(4096, generator=torch.Generator().manual_seed(10 * step + comm.rank))
            if comm.rank == 1:
                g = HUGE * torch.sign(g)  # finite, every step
            before = None if r.residual is None else r.residual.clone()
            try:
                out = r.reduce(g)
            except FloatingPointError:
                if comm.rank == 1:
                    seen["step"] = step
                    seen["unchanged"] = before is not None and torch.equal(r.residual, before)
                raise
            if not (torch.isfinite(out).all() and (r.residual is None or torch.isfinite(r.residual).all())):
                seen[comm.rank] = f"non-finite output or residual at step {step}, no error"
        return True

    return ss.run_local(w, 4, backend="thread", timeout=60)


@pytest.mark.parametrize("name", REDUCERS)
def test_residual_overflow_raises_naming_the_residual(name, kernel):
    seen = {}
    try:
        _run(name, seen)
    except FloatingPointError as e:
        if name == "s2":  # its count sketch sums several values per cell: that sum overflows first
            assert str(e).startswith("rank 1: s2.reduce: the count sketch overflowed at step 0"), str(e)
            return
        assert str(e).startswith(f"rank 1: {name}.reduce: the error-feedback residual overflowed at step "), str(e)
        assert "although the gradient is finite" in str(e) and "nothing was sent" in str(e)
        assert seen["unchanged"], "the residual changed although the step raised"
        return
    # no error is right only where nothing accumulates: no residual (dense), or everything large is sent
    assert not {k: v for k, v in seen.items() if isinstance(k, int)}, seen


def test_a_reducer_with_a_residual_does_raise(kernel):
    """Guard for the test above: its silent branch must not be the only one taken."""
    with pytest.raises(FloatingPointError, match="residual overflowed"):
        _run("micro", {})
    with pytest.raises(FloatingPointError, match="residual overflowed"):
        _run("blocksparse", {})  # kept +-Inf in its residual while its output stayed finite


def test_nan_gradient_is_still_named_as_the_gradient(kernel):
    def w(comm):
        r = make_reducer("micro", comm, 0.05)
        r.reduce(torch.randn(4096))
        g = torch.randn(4096)
        if comm.rank == 2:
            g[7] = float("nan")
        return r.reduce(g)

    with pytest.raises(FloatingPointError, match=r"rank 2: micro.reduce got a non-finite gradient at step 1 \(1 NaN"):
        ss.run_local(w, 3, backend="thread", timeout=60)
