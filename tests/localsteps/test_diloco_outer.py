"""ss.DiLoCo's outer optimizer (torchft's convention: the module's parameters set to the shared ones,
the averaged pseudo-gradient as their ``.grad``, ``outer_optimizer.step()``): the numbers of the
default Nesterov SGD and of a caller's Adam against a hand-written dense reference, the synchronous
SGD special case through a caller's optimizer, bitwise agreement of ranks on gloo with the inner
gradients left as they were, bitwise resume with the outer optimizer's state in ``dl.state_dict()``,
and the optimizer's validation before anything is set up."""

import io

import pytest
import torch

import sparsync as ss

P, H, OUTER_STEPS, INNER_LR = 3, 3, 3, 0.1


def _model(seed=0):
    """Parameters drawn from a private generator (thread ranks share torch's global RNG)."""
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g))
    return m


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)


def _backward(model, step, rank):
    x, y = _batch(step, rank)
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.cross_entropy(model(x), y).backward()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _inner(model):
    return torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=0.5)


def _outer(kind, model):
    """A caller's outer optimizer (None: DiLoCo's default)."""
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.05)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return None


# ------------------------------------------------------------------ the hand-written dense reference
def _nesterov(lr, mu, nesterov=True):
    """torch's SGD with momentum: b = mu b + g (b = g at first), step lr (g + mu b), or lr b without Nesterov."""
    def update(params, grads, state, t):
        for i, (p, g) in enumerate(zip(params, grads)):
            b = g.clone() if i not in state else mu * state[i] + g
            state[i] = b
            p -= lr * (g + mu * b if nesterov else b)
    return update


def _adam(lr, b1=0.9, b2=0.999, eps=1e-8):
    def update(params, grads, state, t):
        for i, (p, g) in enumerate(zip(params, grads)):
            m, v = state.get(i, (torch.zeros_like(g), torch.zeros_like(g)))
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            state[i] = (m, v)
            p -= lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    return update


def _reference(update):
    """P ranks simulated in one process: H inner steps each, then the average of ``shared - local``
    as the gradient of one outer update of the shared parameters, which every rank restarts from.
    The shared parameters (flat) after every outer step."""
    shared = [p.detach().clone() for p in _model().parameters()]
    models = [_model() for _ in range(P)]
    inners = [_inner(m) for m in models]
    state, out, step = {}, [], 0
    for t in range(1, OUTER_STEPS + 1):
        for _ in range(H):
            for r, (m, opt) in enumerate(zip(models, inners)):
                _backward(m, step, r)
                opt.step()
            step += 1
        avg = [sum(s - list(m.parameters())[i].detach() for m in models) / P for i, s in enumerate(shared)]
        update(shared, avg, state, t)
        with torch.no_grad():
            for m in models:
                for p, s in zip(m.parameters(), shared):
                    p.copy_(s)
        out.append(torch.cat([s.reshape(-1) for s in shared]))
    return out


def _diloco_rank(comm, kind):
    model = _model()
    dl = ss.DiLoCo(model, comm, _inner(model), sync_every=H, outer_optimizer=_outer(kind, model))
    out = []
    for step in range(H * OUTER_STEPS):
        _backward(model, step, comm.rank)
        dl.step()
        if dl.last_stats["synced"]:
            out.append(_flat(model))
    return out


@pytest.mark.parametrize("kind, right, wrong", [
    ("default", _nesterov(0.7, 0.9), {"no nesterov": _nesterov(0.7, 0.9, nesterov=False),
                                      "lr squared": _nesterov(0.49, 0.9)}),
    ("sgd", _nesterov(0.7, 0.9), {"no nesterov": _nesterov(0.7, 0.9, nesterov=False)}),
    ("adam", _adam(0.05), {"lr squared": _adam(0.0025), "no momentum": _adam(0.05, b1=0.0)}),
], ids=["default", "sgd", "adam"])
def test_outer_step_numbers_match_a_dense_reference(kind, right, wrong):
    """The module's parameters after each of three outer steps (3 thread ranks, H = 3, inner SGD with
    momentum, dense reducer) follow the hand-written reference within 1e-5 (summation order of the
    average only), on every rank; the reference with Nesterov off, the outer lr squared or Adam's first
    moment off is farther from it than 1e-3, so any of those mistakes fails here."""
    ref = _reference(right)
    for name, update in wrong.items():
        gap = max(float((a - b).abs().max()) for a, b in zip(ref, _reference(update)))
        assert gap > 1e-3, (name, gap)
    for rows in ss.run_local(_diloco_rank, P, kind, backend="thread"):
        assert len(rows) == OUTER_STEPS
        for got, want in zip(rows, ref):
            assert float((got - want).abs().max()) <= 1e-5


# ------------------------------------------------------------------ H = 1 through a caller's optimizer
def _h1_sync_sgd(comm):
    model = _model()
    dl = ss.DiLoCo(model, comm, torch.optim.SGD(model.parameters(), lr=INNER_LR), sync_every=1,
                   outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    ref = _model()
    gaps = []
    for step in range(6):
        _backward(model, step, comm.rank)
        dl.step()
        grads = []
        for r in range(comm.world_size):  # synchronous SGD by hand: the mean of every rank's gradient
            _backward(ref, step, r)
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= INNER_LR * sum(g[i] for g in grads) / comm.world_size
        gaps.append(float((_flat(model) - _flat(ref)).abs().max()))
    return gaps, float((_flat(ref) - _flat(_model())).abs().max())


def test_h1_dense_outer_sgd_lr1_is_synchronous_sgd():
    """H = 1, dense, a caller's ``SGD(lr=1)`` (no momentum), inner plain SGD: synchronous SGD within
    2e-6 over 6 steps (one rounding of ``shared - (shared - lr g)`` per step), while the run moves the
    parameters by far more."""
    for gaps, moved in ss.run_local(_h1_sync_sgd, P, backend="thread"):
        assert moved > 1e-2
        assert max(gaps) <= 2e-6, gaps


# ------------------------------------------------------------------ ranks bitwise equal on gloo
def _gloo_ranks(comm, kind):
    torch.set_num_threads(1)
    model = _model(seed=comm.rank)  # different on every rank: construction broadcasts rank 0's
    dl = ss.DiLoCo(model, comm, _inner(model), sync_every=H, reducer="topka", density=0.1,
                   outer_optimizer=_outer(kind, model))
    rows = []
    for step in range(H * OUTER_STEPS):
        _backward(model, step, comm.rank)
        grads = [p.grad for p in model.parameters()]
        values = [g.clone() for g in grads]
        before = _flat(model)
        dl.step()
        if dl.last_stats["synced"]:
            mine = _flat(model)
            outer_state = [t.reshape(-1) for st in dl.outer_optimizer.state.values() for t in st.values()
                           if isinstance(t, torch.Tensor)]
            rows.append({"differed": any(not torch.equal(v, before) for v in comm.allgather(before.clone())),
                         "same": all(torch.equal(v, mine) for v in comm.allgather(mine.clone())),
                         "state_same": all(torch.equal(v, torch.cat(outer_state))
                                           for v in comm.allgather(torch.cat(outer_state))),
                         "grads_kept": all(p.grad is g and torch.equal(g, v)
                                           for p, g, v in zip(model.parameters(), grads, values))})
    return rows


def _gloo_all(comm):
    return {kind: _gloo_ranks(comm, kind) for kind in ("default", "adam")}


def test_ranks_hold_bitwise_equal_parameters_and_outer_state_on_gloo():
    """3 gloo ranks, topka pseudo-gradients, the default outer SGD and a caller's Adam: after every outer
    step every rank holds bitwise the same parameters (they differed just before) and the same outer
    optimizer state (momentum, Adam's moments), and each parameter's ``.grad`` is still the inner
    gradient tensor of the last backward, unchanged."""
    for by_kind in ss.run_local(_gloo_all, P, backend="gloo", timeout=120):
        for kind, rows in by_kind.items():
            assert len(rows) == OUTER_STEPS
            for row in rows:
                assert all(row.values()), (kind, row)


# ------------------------------------------------------------------ bitwise resume mid-cycle
def _resume(comm, reducer, outer, steps=11, cut=7):
    def build():
        model = _model()
        inner = _inner(model)
        return model, inner, ss.DiLoCo(model, comm, inner, sync_every=4, reducer=reducer, density=0.1,
                                       outer_optimizer=outer(model.parameters(), lr=0.05))

    def train(model, dl, steps):
        for step in steps:
            _backward(model, step, comm.rank)
            dl.step()

    model, _, dl = build()
    train(model, dl, range(steps))
    straight = _flat(model)

    model, inner, dl = build()
    train(model, dl, range(cut))
    assert 0 < dl.inner_step < 4 and dl.outer_step == 1
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": dl.state_dict()}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    moments = {k for st in blob["diloco"]["outer_optimizer"]["state"].values() for k in st}
    model, inner, dl = build()
    model.load_state_dict(blob["model"])
    inner.load_state_dict(blob["inner"])
    dl.load_state_dict(blob["diloco"])
    train(model, dl, range(cut, steps))
    return torch.equal(straight, _flat(model)), moments


@pytest.mark.parametrize("reducer, outer, keys", [
    ("dense", torch.optim.Adam, {"exp_avg", "exp_avg_sq", "step"}),
    ("topka", torch.optim.Adam, {"exp_avg", "exp_avg_sq", "step"}),
    # factored second moments: row_var (m, 1) and col_var (1, n) of an (m, n) parameter, not its shape
    ("dense", getattr(torch.optim, "Adafactor", None), {"row_var", "col_var", "variance", "step"}),
], ids=["adam-dense", "adam-topka", "adafactor-dense"])
def test_resume_mid_cycle_with_a_caller_outer_optimizer_is_bitwise(reducer, outer, keys):
    """A caller's Adam (or Adafactor, whose state tensors are not parameter-shaped) as the outer
    optimizer: its state is in ``dl.state_dict()``, and a run cut in
    the middle of its second outer cycle and resumed into fresh objects ends bitwise where the
    uninterrupted run ends (2 thread ranks; topka's residual in the state too)."""
    if outer is None:
        pytest.skip("this torch has no torch.optim.Adafactor")
    for same, moments in ss.run_local(_resume, 2, reducer, outer, backend="thread"):
        assert keys <= moments
        assert same


# ------------------------------------------------------------------ the optimizer's validation
def _refused_before_setup(comm):
    """What a refused construction sent (nothing), and what a valid one sends (the initial broadcast)."""
    model = _model(seed=comm.rank)
    other = _model()
    bad = {"subset": torch.optim.SGD(list(model.parameters())[:2], lr=0.1),
           "another module's": torch.optim.SGD(other.parameters(), lr=0.1),
           "extra": torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.zeros(2))], lr=0.1)}
    out = {}
    for name, opt in bad.items():
        try:
            ss.DiLoCo(model, comm, _inner(model), sync_every=2, outer_optimizer=opt)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    refused = comm.ledger.rounds
    ss.DiLoCo(model, comm, _inner(model), sync_every=2)
    return out, refused, comm.ledger.rounds


def test_an_outer_optimizer_over_other_parameters_is_refused_before_anything_is_set_up():
    """Over part of the parameters, another module's, or one tensor more: a one-line ValueError naming
    the count, raised before the initial broadcast (no round of communication, while a valid construction has one)."""
    for out, refused, valid in ss.run_local(_refused_before_setup, 2, backend="thread"):
        for name, msg in out.items():
            assert msg is not None and "\n" not in msg and "exactly the module's 4 trainable" in msg, (name, msg)
        assert refused == 0 < valid


def test_outer_optimizer_arguments_are_checked():
    from sparsync.threadcomm import ThreadWorld

    c = ThreadWorld(1).comms()[0]
    m = _model()
    inner = _inner(m)
    with pytest.raises(ValueError, match=r"^outer_lr configure the default outer SGD"):
        ss.DiLoCo(m, c, inner, sync_every=2, outer_lr=0.5, outer_optimizer=_outer("adam", m))
    with pytest.raises(ValueError, match=r"^outer_lr and outer_momentum"):
        ss.DiLoCo(m, c, inner, 2, "dense", 0.01, 0.7, 0.9, outer_optimizer=_outer("adam", m))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        ss.DiLoCo(m, c, inner, sync_every=2, outer_optimizer=object())
    with pytest.raises(ValueError, match="not the inner optimizer"):
        ss.DiLoCo(m, c, inner, sync_every=2, outer_optimizer=inner)
    # frozen parameters are not the outer optimizer's: over the trainable ones it is accepted
    m[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="exactly the module's 3 trainable parameters.*holds 1 other"):
        ss.DiLoCo(m, c, inner, sync_every=2, outer_optimizer=torch.optim.Adam(m.parameters()))
    trainable = [p for p in m.parameters() if p.requires_grad]
    dl = ss.DiLoCo(m, c, inner, sync_every=2, outer_optimizer=torch.optim.Adam(trainable))
    assert dl.outer_lr is None and dl.outer_momentum is None
    dl = ss.DiLoCo(m, c, inner, sync_every=2)  # the default: DiLoCo's Nesterov SGD over the trainable parameters
    group = dl.outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    assert [id(p) for p in group["params"]] == [id(p) for p in trainable]


def test_default_outer_step_follows_the_inner_optimizer_family():
    """Nesterov SGD 0.7 / 0.9 under an SGD inner optimizer; plain averaging (lr 1, no momentum) under
    Adam / AdamW, in the library and in the trainer's configuration alike."""
    from sparsync.localsteps.outer import default_outer
    from sparsync.train.config import TrainConfig
    from sparsync.train.validation import validate

    def outer(inner_cls):
        def w(comm):
            m = torch.nn.Linear(3, 2)
            d = ss.DiLoCo(m, comm, inner_cls(m.parameters(), lr=0.1), sync_every=4)
            return d.outer_lr, d.outer_momentum, d.outer_optimizer.defaults["nesterov"]

        return ss.run_local(w, 1, backend="thread")[0]

    assert outer(torch.optim.SGD) == (0.7, 0.9, True)
    assert outer(torch.optim.AdamW) == outer(torch.optim.Adam) == (1.0, 0.0, False)
    assert default_outer("adamw") == (1.0, 0.0) and default_outer("nesterov") == (0.7, 0.9)
    cfg = TrainConfig(workload="gpt", reducer="dense", workers=2, local_steps={"sync_every": 8})
    validate(cfg)
    assert cfg.optimizer == "adamw" and (cfg.local_steps["outer_lr"], cfg.local_steps["outer_momentum"]) == (1.0, 0.0)


def test_sparseloco_under_adam_sums_the_ranks_parts_by_default():
    """With the sparseloco exchange under Adam / AdamW the default outer step is SGD at lr = world size,
    no momentum (the sum of the ranks' sent parts); under SGD and with other reducers nothing changes."""
    from sparsync.localsteps.outer import default_outer
    from sparsync.train.config import TrainConfig
    from sparsync.train.validation import validate

    def outer(inner_cls, reducer):
        def w(comm):
            m = torch.nn.Linear(3, 2)
            d = ss.DiLoCo(m, comm, inner_cls(m.parameters(), lr=0.1), sync_every=4, reducer=reducer, density=0.5)
            return d.outer_lr, d.outer_momentum

        return ss.run_local(w, 3, backend="thread")[0]

    assert outer(torch.optim.AdamW, "sparseloco") == (3.0, 0.0)
    assert outer(torch.optim.SGD, "sparseloco") == (0.7, 0.9)
    assert outer(torch.optim.AdamW, "topka") == (1.0, 0.0)
    assert default_outer("adam", "sparseloco", 8) == (8.0, 0.0) and default_outer("adamw", "dense", 8) == (1.0, 0.0)
    cfg = TrainConfig(workload="gpt", reducer="sparseloco", workers=4, local_steps={"sync_every": 8})
    validate(cfg)
    assert (cfg.local_steps["outer_lr"], cfg.local_steps["outer_momentum"]) == (4.0, 0.0)
