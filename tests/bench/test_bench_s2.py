"""bench/s2's sparse-path timing goes through the shared timing loop: the right inputs per step,
one record per timed step, and the step-0 output it reports is the exact sum (lossless reducer)."""

import pytest
import torch

import sparsync as ss
from sparsync.bench.s2 import _time_sparse

V, D = 64, 8


def _coo(rank: int, s: int) -> torch.Tensor:
    """Uncoalesced COO gradient with a step-dependent number of distinct rows (3 + 4 s)."""
    g = torch.Generator().manual_seed(100 * rank + s)
    rows = torch.randperm(V, generator=g)[: 3 + 4 * s]
    rows = torch.cat([rows, rows[:1]])  # one duplicate: uncoalesced, as autograd produces it
    return torch.sparse_coo_tensor(rows.view(1, -1), torch.randn(rows.numel(), D, generator=g), (V, D),
                                   check_invariants=False)


def _run(comm, name, steps, warmup):
    grads = [_coo(comm.rank, s) for s in range(3)]
    recs, first = _time_sparse(comm, name, grads, steps, warmup, embedding_density=0.25)
    return recs, first, grads


@pytest.mark.parametrize("name", ["blocksparse", "s2"])
def test_time_sparse_cycles_inputs_and_records_every_timed_step(name):
    steps, warmup, P = 4, 2, 2
    res = ss.run_local(_run, P, name, steps, warmup, backend="thread", timeout=60)
    for recs, _first, grads in res:
        assert len(recs) == steps
        for i, rec in enumerate(recs):
            g = grads[(warmup + i) % len(grads)].coalesce()  # timed step i ran input warmup + i
            assert rec["selected"] == g.indices().numel() * D
            assert rec["wall_s"] > 0 and rec["bytes_received"] > 0
    if name == "blocksparse":  # lossless: the reported step-0 output is the exact sum of grads[0]
        exact = sum(grads[0].to_dense() for _r, _f, grads in res)
        for _recs, first, _g in res:
            torch.testing.assert_close(first, exact, rtol=1e-6, atol=1e-6)
