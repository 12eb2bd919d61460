"""Recycled result buffers without torch's private storage use count (``sparsync.recycle``): when
``torch._C._storage_Use_Count`` fails, nothing is recycled, one RuntimeWarning names the reason, and
every reducer's results are bitwise those with recycling."""

import warnings

import pytest
import torch

import sparsync as ss
from sparsync import recycle
from sparsync.reducers.registry import make_reducer


def _broken(monkeypatch):
    def use_count(_cdata):
        raise AttributeError("module 'torch._C' has no attribute '_storage_Use_Count'")

    monkeypatch.setattr(torch._C, "_storage_Use_Count", use_count)
    monkeypatch.setattr(recycle, "_warned", False)


def test_recycling_works_silently_with_the_use_count():
    pool = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = recycle.recycled(pool, 64, torch.float32, "cpu")
        pa = a.data_ptr()
        del a
        b = recycle.recycled(pool, 64, torch.float32, "cpu", zero=True)
    assert b.data_ptr() == pa and len(pool) == 1 and not b.any()


def test_without_the_use_count_nothing_is_recycled_and_one_warning_names_why(monkeypatch):
    _broken(monkeypatch)
    pool = []
    with pytest.warns(RuntimeWarning, match=r"not recycled.*_storage_Use_Count: AttributeError") as rec:
        outs = []
        for _ in range(4):
            x = recycle.recycled(pool, 64, torch.float32, "cpu", zero=True)
            assert not x.any()
            x.fill_(1.0)
            outs.append(x)
    assert len(pool) == 0  # nothing kept: no buffer can be handed out twice
    assert len({o.data_ptr() for o in outs}) == 4 and all(bool((o == 1).all()) for o in outs)
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1  # once, not per call


def _run(comm, name):
    opts = {"reuse_buffers": True} if name == "micro" else {}
    r = make_reducer(name, comm, 0.05, **opts)
    outs = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + comm.rank)
        outs.append(r.reduce(torch.randn(4096, generator=g)))  # kept, not copied: never overwritten
    return outs


@pytest.mark.parametrize("name", ["dense", "topka", "micro"])
def test_reducer_results_are_unchanged_without_recycling(name, monkeypatch):
    want = ss.run_local(_run, 3, name, backend="thread", timeout=60)
    _broken(monkeypatch)
    with pytest.warns(RuntimeWarning, match="not recycled"):
        got = ss.run_local(_run, 3, name, backend="thread", timeout=60)
    for w_rank, g_rank in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(w_rank, g_rank)), name
