"""A reducer's state resumed on another world size: conserving and consistent, or refused in one line.

Saved after a few steps at P = 4 (each rank's own state), loaded at P = 2 (ranks 0, 1 take the states
of ranks 0, 1; the residuals of ranks 2, 3 are lost, with a warning: not a bitwise resume) and at
P = 8 (ranks 4..7 start fresh). The next steps must keep the conservation identity with the LOADED
residuals - ``sum_r (grad_r + residual_loaded_r) == out + sum_r residual_after_r`` - and give every
rank the same bits; a reducer that cannot re-derive what depends on the world size must refuse the
state with a one-line ``ValueError`` instead (nothing changed). Dyadic fp32 values: every partial sum
is exact, so any summation order gives the same bits.
"""

import warnings

import pytest
import torch

import sparsync as ss
from sparsync.reducers.registry import load_all

N = 1200
SAVED_AT = 4
#: options that make a reducer conserving (or runnable) at every P tried
OPTIONS = {"gtopk": {"residuals": "global"}, "sparcml": {"dense_below": 0},
           "sparseloco": {"value_bits": 32, "ef_decay": 1.0, "chunk": 100}}  # exact: fp32, undecayed


def _names():
    reg = load_all()
    return sorted(n for n in reg if reg.lookup(n).has_memory and n != "hier")


def _dyadic(gen, n):
    return torch.randint(-64, 65, (n,), generator=gen).to(torch.float32) / 64


def _make(comm, name):
    opts = dict(OPTIONS.get(name, {}))
    if name == "hier":
        opts["sites"] = f"2x{comm.world_size // 2}"
    return ss.make_reducer(name, comm, density=0.05, **opts)


def _save(comm, name, steps):
    r = _make(comm, name)
    gen = torch.Generator().manual_seed(7 + comm.rank)
    for _ in range(steps):
        r.reduce(_dyadic(gen, N))
    return r.state_dict()


def _resume(comm, name, states):
    r = _make(comm, name)
    gen = torch.Generator().manual_seed(900 + comm.rank)
    if comm.rank < len(states):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r.load_state_dict(states[comm.rank])
        except ValueError as e:
            return ("refused", str(e))
    rows = []
    for _ in range(3):
        before = None if r.residual is None else r.residual.clone()
        g = _dyadic(gen, N)
        out = r.reduce(g.clone())
        rows.append((g, before, out.clone(), None if r.residual is None else r.residual.clone()))
    return ("ran", rows, r.conserving)


@pytest.mark.parametrize("P", [2, 8])
@pytest.mark.parametrize("name", _names() + ["hier"])
def test_state_from_another_world_size_conserves_or_is_refused(name, P):
    states = ss.run_local(_save, SAVED_AT, name, 70, backend="thread")  # past Ok-Topk's first re-balance
    res = ss.run_local(_resume, P, name, states, backend="thread")
    kinds = {r[0] for r in res}
    if kinds == {"refused"}:
        for _, msg in res[:min(P, SAVED_AT)]:
            assert "\n" not in msg and "world size" in msg, (name, msg)
        return
    assert kinds == {"ran"}, (name, [r[:2] if r[0] == "refused" else r[0] for r in res])
    zero = torch.zeros(N)
    for s in range(3):
        out = res[0][1][s][2]
        assert all(torch.equal(res[w][1][s][2], out) for w in range(P)), (name, P, s)
        if not res[0][2]:
            continue
        fed = sum(res[w][1][s][0] + (zero if res[w][1][s][1] is None else res[w][1][s][1]) for w in range(P))
        kept = sum(zero if res[w][1][s][3] is None else res[w][1][s][3] for w in range(P))
        assert torch.equal(fed, out + kept), (name, P, s, float((fed - out - kept).abs().max()))
