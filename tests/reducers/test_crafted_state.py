"""Crafted reducer states are refused in one line, and the reducer is left exactly as it was.

For ``auto`` (its active candidate, its carried residual, its candidate's state), Ok-Topk (its
partition) and the fields every reducer has (step, residual, numel, rank): each crafted variant of a
real state must raise a one-line ``ValueError``, and the reducer's ``state_dict()`` after the refusal
must be bitwise the one before. Then the real state still loads and the next steps stay bitwise equal
across ranks.
"""

import copy

import pytest
import torch

import sparsync as ss

N = 600


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _set(d, path, value):
    d = copy.deepcopy(d)
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


CRAFTED = {
    "auto": [(("extra", "active"), -1), (("extra", "active"), 99), (("extra", "active"), "x"),
             (("extra", "carry"), torch.full((1,), 1e3)), (("extra", "carry"), torch.zeros(N - 1)),
             (("extra", "fresh"), -2)],
    "oktopk": [(("extra", "bounds"), [0, 10, 20, N]), (("extra", "bounds"), [0, 400, 300, N]),
               (("extra", "bounds"), [0, 300, N + 5]), (("extra", "th_global"), float("nan"))],
    "topka": [(("step",), -1), (("residual",), torch.zeros(N + 1)), (("residual",), torch.zeros(2, N // 2)),
              (("numel",), N + 1), (("rank",), 1), (("rank",), 7), (("residual",), torch.full((N,), float("inf")))],
}


def _case(comm, name, crafted):
    opts = {"candidates": ["dense", "micro:0.05", "topka:0.05"]} if name == "auto" else {}
    if name == "auto":  # a carried residual: start on a sparse candidate, then switch
        opts["candidates"] = ["topka:0.05", "micro:0.05"]
    r = ss.make_reducer(name, comm, density=0.05, **opts)
    gen = torch.Generator().manual_seed(3 + comm.rank)
    for _ in range(4):
        r.reduce(torch.randn(N, generator=gen))
    if name == "auto":
        r._switch(1)  # what a decision does: the old candidate's residual becomes auto's carry
    good = r.state_dict()
    msgs = []
    for path, value in crafted:
        bad = _set(good, path, value)
        before = r.state_dict()
        try:
            r.load_state_dict(bad)
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append(None)
        assert _equal(before, r.state_dict()), (name, path, value)  # nothing changed
    r.load_state_dict(good)
    out = r.reduce(torch.randn(N, generator=gen))
    return msgs, out


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_states_are_refused_in_one_line_and_change_nothing(name):
    res = ss.run_local(_case, 2, name, CRAFTED[name], backend="thread")
    for (path, value), msg in zip(CRAFTED[name], res[0][0]):
        assert msg is not None, f"{name}: {path} = {value!r} was accepted"
        assert "\n" not in msg, msg
    assert torch.equal(res[0][1], res[1][1])


def _overflow(comm):
    r = ss.make_reducer("auto", comm, density=0.05, candidates=["topka:0.05", "micro:0.05"])
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        r.reduce(torch.randn(N, generator=gen))
    r._switch(1)
    r.residual = torch.full((N,), 3e38)  # a carried residual on the edge of fp32
    before = r.residual.clone()
    with pytest.raises(FloatingPointError) as e:
        r.reduce(torch.full((N,), 3e38))
    return str(e.value), before, r.residual


def test_auto_keeps_its_carry_when_a_call_raises_and_names_the_residual():
    msg, before, after = ss.run_local(_overflow, 1, backend="thread")[0]
    assert "residual" in msg and "carried" in msg, msg
    assert after is not None and torch.equal(before, after)
