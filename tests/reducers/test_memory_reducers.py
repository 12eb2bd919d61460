"""Error feedback as one component (``reducers/memory.ErrorFeedback``) and the declared reducer capabilities.

* conservation through the memory, for EVERY registered reducer with memory: ``sum_r (grad_r +
  residual_before_r) == out + sum_r residual_after_r`` exactly (dyadic fp32 values: every partial sum
  is exact, so any order of summation gives the same bits), with the input check on (the checked
  two-buffer form) and off (the in-place form), P = 4 thread ranks;
* the fold path (momentum correction adding into ``memory.fold_target``) gives bitwise the result of
  the unfolded path, for every reducer that ``accepts_fold``;
* the fold protocol is explicit state: misuse raises, an assignment of the residual cancels a fold;
* every registered reducer class declares its capabilities as bools, and instances match them;
* the engine and the policy read capabilities as attributes: no ``hasattr``/``getattr`` in
  ``schedule/`` or ``convergence.py``.

This file also runs with the torch kernels (``SPARSYNC_NATIVE=0``, the Makefile's second leg), where
:func:`sparsync.reducers.memory.sum_checked` takes its torch path.
"""

import ast
import pathlib

import pytest
import torch

import sparsync as ss
from sparsync.convergence import ConvergencePolicy, GradientPolicy
from sparsync.reducers.base import CAPABILITIES, IndexedSum, Reducer, check_capabilities
from sparsync.reducers.memory import ErrorFeedback
from sparsync.reducers.registry import load_all

P = 4
N = 1000
STEPS = 3
#: options that make a reducer conserving (or runnable) at P = 4
OPTIONS = {"auto": {"candidates": "micro"}, "gtopk": {"residuals": "global"}, "hier": {"sites": "2x2"},
           "sparcml": {"dense_below": 0},
           "sparseloco": {"value_bits": 32, "ef_decay": 1.0, "chunk": 100}}  # exact: fp32, undecayed


def _memory_reducers():
    reg = load_all()
    return sorted(n for n in reg if reg.lookup(n).has_memory)


def _dyadic(gen, n, scale=64):
    """fp32 values k/scale with |k| <= 64: sums of a few hundred of them are exact in fp32."""
    return torch.randint(-64, 65, (n,), generator=gen).to(torch.float32) / scale


def _steps(comm, name, nonfinite):
    r = ss.make_reducer(name, comm, density=0.05, nonfinite=nonfinite, **OPTIONS.get(name, {}))
    gen = torch.Generator().manual_seed(100 + comm.rank)
    rows = []
    for _ in range(STEPS):
        g = _dyadic(gen, N)
        before = None if r.residual is None else r.residual.clone()
        out = r.reduce(g.clone())
        after = None if r.residual is None else r.residual.clone()
        rows.append((g, before, out.clone(), after))
    return rows, r.conserving


@pytest.mark.parametrize("nonfinite", ["error", "ignore"])
@pytest.mark.parametrize("name", _memory_reducers())
def test_every_reducer_with_memory_conserves_exactly(name, nonfinite):
    res = ss.run_local(_steps, P, name, nonfinite, backend="thread")
    conserving = res[0][1]
    if not conserving:
        pytest.skip(f"{name} is not conserving by design")
    zero = torch.zeros(N)
    sent_any = False
    for s in range(STEPS):
        out = res[0][0][s][2]
        assert all(torch.equal(res[w][0][s][2], out) for w in range(P)), (name, s)  # bitwise on every rank
        fed = sum(res[w][0][s][0] + (zero if res[w][0][s][1] is None else res[w][0][s][1]) for w in range(P))
        kept = sum(zero if res[w][0][s][3] is None else res[w][0][s][3] for w in range(P))
        assert torch.equal(fed, out + kept), (name, s, float((fed - out - kept).abs().max()))
        sent_any |= bool(out.abs().sum() > 0)
        if s:  # the memory carries what was not sent into the next step
            assert all(torch.equal(res[w][0][s][1], res[w][0][s - 1][3]) for w in range(P)), (name, s)
    assert sent_any and any(res[w][0][-1][3].abs().sum() > 0 for w in range(P)), name


def _fold_runs(comm, name, nesterov):
    """The same momentum-corrected steps through the unfolded and the folded path."""
    results = []
    for fold in (False, True):
        r = ss.make_reducer(name, comm, density=0.05, **OPTIONS.get(name, {}))
        pol = GradientPolicy(momentum=0.9, nesterov=nesterov)
        gen = torch.Generator().manual_seed(7 + comm.rank)
        outs, folded = [], 0
        for _ in range(4):
            grads = [torch.randn(300, generator=gen), None, torch.randn(200, generator=gen)]
            numels = [300, 50, 200]
            target = r.memory.fold_target(550, torch.float32, torch.device("cpu")) if fold else None
            if target is None:
                x = pol.before_reduce_parts(0, grads, numels, grads[0], r)
            else:
                x = pol.before_reduce_parts(0, grads, numels, grads[0], r, fold_into=target)
                r.memory.mark_folded()
                folded += 1
            outs.append(r.reduce(x).clone())
            pol.after_reduce(0, r)
        results.append((outs, r.residual.clone(), pol.velocity[0].clone(), folded))
    return results


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("name", sorted(n for n in load_all() if load_all().lookup(n).accepts_fold))
def test_fold_path_is_bitwise_the_unfolded_path(name, nesterov):
    res = ss.run_local(_fold_runs, P, name, nesterov, backend="thread")
    for w in range(P):
        (o1, r1, u1, f1), (o2, r2, u2, f2) = res[w]
        assert f1 == 0 and f2 == 3, (name, f2)  # steps 1..3 folded (step 0 has no residual yet)
        assert all(torch.equal(a, b) for a, b in zip(o1, o2)), name
        assert torch.equal(r1, r2) and torch.equal(u1, u2), name


def test_fold_protocol_is_explicit_state():
    m = ErrorFeedback(in_place=True)
    g = torch.ones(8)
    assert m.fold_target(8, torch.float32, g.device) is None  # no residual yet
    with pytest.raises(RuntimeError, match="no residual"):
        m.mark_folded()
    acc = m.add(g)
    m.keep(acc, torch.tensor([0, 3]))
    t = m.fold_target(8, torch.float32, g.device)
    assert t is m.residual
    assert m.fold_target(9, torch.float32, g.device) is None and m.fold_target(8, torch.float64, g.device) is None
    t.add_(g)
    m.mark_folded()
    with pytest.raises(RuntimeError, match="fold target"):
        m.add(t.clone())
    t.add_(g)  # the flag was consumed by the refused add: a new fold
    m.mark_folded()
    assert m.add(t) is t and torch.equal(t, torch.tensor([2.0, 3, 3, 2, 3, 3, 3, 3]))
    m.keep(t)  # the fold was consumed by that add: the next one adds its input again
    assert torch.equal(m.add(g), torch.tensor([3.0, 4, 4, 3, 4, 4, 4, 4]))
    m.keep(m.residual)
    m.mark_folded()
    m.residual = torch.zeros(8)  # an assignment cancels the pending fold: the next add adds
    assert torch.equal(m.add(g), g)
    assert ErrorFeedback(in_place=False).fold_target(8, torch.float32, g.device) is None


def test_checked_two_buffer_form_leaves_the_residual_on_nonfinite_input():
    calls = []

    def on_bad(values, residual):
        calls.append(residual)
        raise FloatingPointError("bad")

    m = ErrorFeedback(in_place=True, on_nonfinite=on_bad)
    m.keep(m.add(torch.arange(6.0)), torch.tensor([5]))
    before = m.residual.clone()
    bad = torch.ones(6)
    bad[2] = float("nan")
    with pytest.raises(FloatingPointError):
        m.add(bad)
    assert torch.equal(m.residual, before) and calls and calls[0] is m.residual
    acc = m.add(torch.ones(6))  # the checked form writes the other buffer: the residual is still intact
    assert acc.untyped_storage().data_ptr() != m.residual.untyped_storage().data_ptr()
    assert torch.equal(acc, before + 1) and torch.equal(m.residual, before)


def test_take_keeps_the_half_precision_rounding_error():
    m = ErrorFeedback(wire_dtype=torch.float16)
    g = torch.tensor([1.0 + 2 ** -20, 3.0, 70000.0, -0.1])
    acc = m.add(g)
    idx = torch.tensor([0, 2, 3])
    vals, sent = m.take(acc, idx)
    assert sent.dtype == torch.float16 and torch.equal(vals, g[idx])
    assert torch.equal(m.residual.index_select(0, idx) + sent.float(), g[idx])  # acc == residual + sent
    assert m.residual[1] == 3.0


def test_padded_add_alternates_two_buffers_never_the_residual():
    m = ErrorFeedback()
    seen = set()
    for s in range(4):
        A = m.add(torch.full((5,), float(s)), padded=8)
        assert torch.equal(A[5:], torch.zeros(3))
        assert m.residual is None or A.untyped_storage().data_ptr() != m.residual.untyped_storage().data_ptr()
        m.keep(A[:5])
        seen.add(A.untyped_storage().data_ptr())
    assert len(seen) == 2 and torch.equal(m.residual, torch.full((5,), 6.0))


@pytest.mark.parametrize("name", sorted(load_all()))
def test_every_registered_reducer_declares_its_capabilities(name):
    cls = load_all().lookup(name)
    check_capabilities(cls)
    for cap in CAPABILITIES:
        assert isinstance(getattr(cls, cap), bool), (name, cap)
    assert cls.sparse_input == (cls.reduce_sparse is not Reducer.reduce_sparse)

    def build(comm):
        r = ss.make_reducer(name, comm, density=0.1, **OPTIONS.get(name, {}))
        out = r.reduce(torch.arange(64, dtype=torch.float32) - 20, indexed=True)
        return r, out

    r, out = ss.run_local(build, P, backend="thread")[0]
    if cls.has_memory:
        assert isinstance(r.memory, ErrorFeedback)
        assert r.memory.in_place == (cls.accepts_fold and r.reuse_buffers)
    else:
        assert r.memory is None and r.residual is None
        with pytest.raises(ValueError, match="keeps no residual"):
            r.residual = torch.zeros(64)
    assert "indexed_output" not in vars(r) and isinstance(out, IndexedSum) == cls.indexed_output  # a class fact
    if not cls.sparse_input:
        with pytest.raises(TypeError, match="no sparse gradients"):
            r.reduce_sparse(torch.zeros(4, 2).to_sparse())


def test_capabilities_are_checked_at_registration():
    class Bad(Reducer):
        accepts_fold = 1

    class NoMemoryFold(Reducer):
        has_memory = False
        accepts_fold = True

    class Sparse(Reducer):
        sparse_input = True

    for cls, msg in ((Bad, "must be a bool"), (NoMemoryFold, "needs has_memory"), (Sparse, "reduce_sparse")):
        with pytest.raises(TypeError, match=msg):
            check_capabilities(cls)


def test_engine_checks_the_policy_interface():
    class Odd(ConvergencePolicy):
        folds = "yes"

    def make(comm, policy):
        ss.SparseDDP(torch.nn.Linear(2, 2), comm, policy=policy)

    with pytest.raises(TypeError, match="ConvergencePolicy"):
        ss.run_local(make, 1, object(), backend="thread")
    with pytest.raises(TypeError, match="folds must be a bool"):
        ss.run_local(make, 1, Odd(), backend="thread")


def test_no_capability_probing_in_the_engine_or_the_policy():
    """``schedule/`` and ``convergence.py`` read declared attributes; they never call hasattr/getattr."""
    root = pathlib.Path(ss.__file__).parent
    files = sorted((root / "schedule").glob("*.py")) + [root / "convergence.py"]
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in ("hasattr", "getattr"):
                found.append(f"{f.name}:{node.lineno} {node.func.id}")
    assert not found, found


def test_memory_state_round_trip_and_reducer_state_keys():
    m = ErrorFeedback(in_place=True)
    m.keep(m.add(torch.arange(5.0)), torch.tensor([1]))
    m2 = ErrorFeedback(in_place=True)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.residual, m.residual) and m2.residual.data_ptr() != m.residual.data_ptr()

    def fn(comm):
        r = ss.make_reducer("topka", comm, density=0.2)
        r.reduce(torch.arange(20.0) - 7)
        s = r.state_dict()
        r2 = ss.make_reducer("topka", comm, density=0.2)
        r2.load_state_dict(s)
        return sorted(s), torch.equal(r2.residual, r.residual), r2.memory is not r.memory

    keys, same, distinct = ss.run_local(fn, 2, backend="thread")[0]
    assert keys == ["density", "extra", "name", "numel", "rank", "residual", "step", "world_size"]
    assert same and distinct


def test_round_to_wire_saturates_like_clamping_first():
    # fp16 wire values: cast, then the cast's infinities back to +-65504 in place - the bits of clamping
    # to +-65504 first (values that round to 65504, that overflow, +-inf), NaN kept, bf16 plain
    from sparsync.reducers.memory import round_to_wire

    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 3e4
    x[:11] = torch.tensor([65504.0, 65505.0, 65519.9, 65520.0, 1e9, -1e9, float("inf"), float("-inf"),
                           float("nan"), -65519.0, 1e-8])
    for dt in (torch.float16, torch.bfloat16):
        want = (x.clamp(-65504.0, 65504.0) if dt == torch.float16 else x).to(dt)
        got = round_to_wire(x, dt)
        assert got.dtype == dt and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert round_to_wire(x, None) is x
