"""ss.DiLoCo.load_state_dict checks the whole state before it changes anything: a crafted state (cycle
position out of range, shapes, dtypes, another rank's or another world size's state or none recorded, an
outer optimizer state of another structure, a reducer state its reducer refuses) is refused in one line and leaves
``dl.state_dict()`` and the module's parameters bitwise as they were; a state of the previous format
(no world size or rank, the outer momentum over flat buffers) still resumes bitwise."""

import copy
import io

import pytest
import torch

import sparsync as ss
from diloco_helpers import classify_step
from sparsync import rankstate

H = 4


def _model():
    m = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g))
    return m


def _step(model, dl, step, rank):
    classify_step(model, dl, step, rank, inputs=5, classes=2, batch=8, seed_base=100)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same(a, b) -> bool:
    """Bitwise equality of nested state (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _build(comm, outer="adam", reducer="topka"):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05) if outer == "adam" else None
    dl = ss.DiLoCo(model, comm, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=H, reducer=reducer,
                   density=0.2, outer_optimizer=opt)
    return model, dl


def _valid_changes(sd):
    """A copy of ``sd`` that is still loadable but differs in every part (so a partial load shows)."""
    sd = copy.deepcopy(sd)
    sd["shared"] = [s + 1 for s in sd["shared"]]
    sd["inner_step"], sd["outer_step"] = (sd["inner_step"] + 1) % H, sd["outer_step"] + 5
    for st in sd["outer_optimizer"]["state"].values():
        for k in ("exp_avg", "exp_avg_sq"):
            st[k] = st[k] * 2
    for r in sd["reducers"]:
        r["residual"] = r["residual"] + 1
    return sd


def _crafted(sd, other_rank_sd):
    """(what, state, what the message must say): each breaks one thing of an otherwise valid state."""
    def with_(**changes):
        d = _valid_changes(sd)
        for k, v in changes.items():
            d[k] = v(d) if callable(v) else v
        return d

    def without(key):  # the current format always records the world size and rank
        d = _valid_changes(sd)
        del d[key]
        return d

    def outer(edit):
        def f(d):
            o = copy.deepcopy(d["outer_optimizer"])
            edit(o)
            return o
        return f

    def reducer(edit):
        def f(d):
            rs = copy.deepcopy(d["reducers"])
            edit(rs[0])
            return rs
        return f

    w = sd["world_size"]
    return [
        ("format", with_(format="sparsync-diloco/9"), "not a DiLoCo state dict"),
        ("world size", with_(world_size=w + 2), f"world size {w + 2} cannot be loaded at world size {w}"),
        ("no world size", without("world_size"), "world_size must be an integer >= 1, got None"),
        ("no rank", without("rank"), "rank must be an integer >= 0, got None"),
        ("world size as text", with_(world_size=str(w)), f"world_size must be an integer >= 1, got '{w}'"),
        ("another rank", other_rank_sd,
         f"saved by rank {other_rank_sd['rank']} cannot be loaded on rank {sd['rank']}"),
        ("sync_every", with_(sync_every=2 * H), f"sync_every={2 * H}"),
        ("reducer name", with_(reducer="dense"), "reducer='dense'"),
        ("inner_step = H", with_(inner_step=H), f"inner_step {H} outside"),
        ("inner_step < 0", with_(inner_step=-1), "inner_step must be an integer >= 0"),
        ("inner_step bool", with_(inner_step=True), "inner_step must be an integer >= 0"),
        ("inner_step float", with_(inner_step=1.0), "inner_step must be an integer >= 0"),
        ("outer_step < 0", with_(outer_step=-1), "outer_step must be an integer >= 0"),
        ("shared shape", with_(shared=lambda d: [d["shared"][0][:-1]]), "shared parameters do not match"),
        ("shared dtype", with_(shared=lambda d: [d["shared"][0].double()]), "shared parameters do not match"),
        ("shared count", with_(shared=lambda d: d["shared"] * 2), "shared parameters do not match"),
        ("outer groups", with_(outer_optimizer=outer(lambda o: o["param_groups"].append(o["param_groups"][0]))),
         "2 param groups"),
        ("outer params", with_(outer_optimizer=outer(lambda o: o["param_groups"][0]["params"].pop())),
         "holds 3 parameters"),
        ("outer keys", with_(outer_optimizer=lambda d: torch.optim.SGD(_model().parameters(), lr=1).state_dict()),
         "has the keys"),
        ("outer moment shape", with_(outer_optimizer=outer(lambda o: o["state"][0].update(exp_avg=torch.zeros(3, 3)))),
         "exp_avg of parameter 0 has shape (3, 3)"),
        ("outer state of no parameter", with_(outer_optimizer=outer(lambda o: o["state"].update({9: {}}))),
         "which no param group holds"),
        ("reducer count", with_(reducers=lambda d: d["reducers"] * 2), "2 reducer states for 1"),
        ("reducer residual", with_(reducers=reducer(lambda r: r.update(residual=r["residual"][:-1]))), "residual"),
        ("reducer step", with_(reducers=reducer(lambda r: r.update(step=-3))), "step must be an integer"),
        ("reducer of another rank", with_(reducers=lambda d: copy.deepcopy(other_rank_sd["reducers"])), "rank"),
    ]


def _refusals(comm):
    model, dl = _build(comm)
    for step in range(H + 2):  # one outer step (Adam's moments and the residual exist), then the middle of a cycle
        _step(model, dl, step, comm.rank)
    other = rankstate.gather(dl.state_dict(), comm)["states"][1 - comm.rank]
    before, params = copy.deepcopy(dl.state_dict()), _flat(model)
    rows = []
    for what, state, expect in _crafted(dl.state_dict(), other):
        try:
            dl.load_state_dict(state)
            msg = None
        except ValueError as e:
            msg = str(e)
        rows.append((what, msg, expect, _same(before, dl.state_dict()) and torch.equal(params, _flat(model))))
    dl.load_state_dict(_valid_changes(dl.state_dict()))  # the crafted states' valid base loads, and shows
    return rows, not _same(before, dl.state_dict())


def test_a_crafted_state_is_refused_in_one_line_and_changes_nothing():
    """2 thread ranks, topka and a caller's Adam, in the middle of the second outer cycle: every crafted
    state - otherwise valid and different in every part - raises a one-line ValueError that names the
    problem, and afterwards ``dl.state_dict()`` and the module's parameters are bitwise what they were."""
    for rows, valid_loads in ss.run_local(_refusals, 2, backend="thread"):
        assert valid_loads
        for what, msg, expect, unchanged in rows:
            assert msg is not None, what
            assert "\n" not in msg and expect in msg, (what, msg)
            assert unchanged, what


def test_a_state_of_another_world_size_names_both_sizes():
    """A state saved by 2 ranks is refused by a world of 1 (and the message names 2 and 1)."""
    states = ss.run_local(lambda comm: _build(comm)[1].state_dict(), 2, backend="thread")
    from sparsync.threadcomm import ThreadWorld

    _, dl = _build(ThreadWorld(1).comms()[0])
    with pytest.raises(ValueError, match=r"saved at world size 2 cannot be loaded at world size 1"):
        dl.load_state_dict(states[0])


def test_an_outer_state_of_other_shapes_is_refused_by_a_fresh_outer_optimizer():
    """Resuming into fresh objects (the outer optimizer holds no state yet, so no shapes to compare
    with): Adam moments that do not broadcast to their parameter are refused in one line with nothing
    changed, while the state as saved loads."""
    from sparsync.threadcomm import ThreadWorld

    comm = ThreadWorld(1).comms()[0]
    model, dl = _build(comm)
    for step in range(H + 1):
        _step(model, dl, step, 0)
    saved = dl.state_dict()
    model, fresh = _build(comm)
    assert not fresh.outer_optimizer.state
    before, params = copy.deepcopy(fresh.state_dict()), _flat(model)
    bad = copy.deepcopy(saved)
    bad["outer_optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 3)  # parameter 0 is (8, 5)
    with pytest.raises(ValueError, match=r"exp_avg of parameter 0 has shape \(3, 3\), which does not broadcast"):
        fresh.load_state_dict(bad)
    assert _same(before, fresh.state_dict()) and torch.equal(params, _flat(model))
    fresh.load_state_dict(saved)
    assert _same(saved, fresh.state_dict())


def test_a_learning_rate_schedulers_group_keys_do_not_block_loading():
    """A state saved with a scheduler on the outer optimizer (its groups carry ``initial_lr``) loads into
    one without a scheduler yet and the other way round: only the optimizer's own hyper-parameters are
    required; an SGD state is still refused by Adam, naming the keys it lacks."""
    from sparsync.threadcomm import ThreadWorld

    comm = ThreadWorld(1).comms()[0]
    model, dl = _build(comm)
    torch.optim.lr_scheduler.StepLR(dl.outer_optimizer, step_size=2)
    for step in range(H + 1):
        _step(model, dl, step, 0)
    with_scheduler = dl.state_dict()
    assert "initial_lr" in with_scheduler["outer_optimizer"]["param_groups"][0]
    _, plain = _build(comm)
    plain.load_state_dict(with_scheduler)
    assert _same(with_scheduler, plain.state_dict())
    _, scheduled = _build(comm)
    torch.optim.lr_scheduler.StepLR(scheduled.outer_optimizer, step_size=2)
    without = copy.deepcopy(with_scheduler)
    del without["outer_optimizer"]["param_groups"][0]["initial_lr"]
    scheduled.load_state_dict(without)
    assert scheduled.outer_step == with_scheduler["outer_step"]
    without["outer_optimizer"] = torch.optim.SGD(_model().parameters(), lr=1).state_dict()
    with pytest.raises(ValueError, match=r"without this outer optimizer's \['amsgrad', 'betas'"):
        plain.load_state_dict(without)


def test_automatic_period_state_is_checked():
    from sparsync.threadcomm import ThreadWorld

    m = _model()
    dl = ss.DiLoCo(m, ThreadWorld(1).comms()[0], torch.optim.SGD(m.parameters(), lr=0.1), sync_every="auto")
    sd = dl.state_dict()
    for bad in ({**sd["period"], "period": 0}, {**sd["period"], "steps": "x"}, None):
        with pytest.raises(ValueError, match="the automatic period must hold"):
            dl.load_state_dict({**sd, "period": bad})
    dl.load_state_dict(sd)


# ------------------------------------------------------------------ the previous format still resumes
def _as_version_1(sd):
    """``sd`` as the previous format wrote it: no world size or rank, the default SGD's momentum as one
    flat buffer over the module's parameters (one (device, dtype) group), under parameter index 0."""
    old = {k: v for k, v in sd.items() if k not in ("world_size", "rank")}
    opt = sd["outer_optimizer"]
    group = opt["param_groups"][0]
    flat = torch.cat([opt["state"][i]["momentum_buffer"].reshape(-1) for i in group["params"]])
    old["outer_optimizer"] = {"state": {0: {"momentum_buffer": flat}}, "param_groups": [{**group, "params": [0]}]}
    old["format"] = "sparsync-diloco/1"
    return old


def _resume_v1(comm, steps=11, cut=6):
    model, dl = _build(comm, outer=None, reducer="dense")
    for step in range(steps):
        _step(model, dl, step, comm.rank)
    straight = _flat(model)
    model, dl = _build(comm, outer=None, reducer="dense")
    for step in range(cut):
        _step(model, dl, step, comm.rank)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": dl.inner_optimizer.state_dict(),
                "diloco": _as_version_1(dl.state_dict())}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    model, dl = _build(comm, outer=None, reducer="dense")
    model.load_state_dict(blob["model"])
    dl.inner_optimizer.load_state_dict(blob["inner"])
    dl.load_state_dict(blob["diloco"])
    for step in range(cut, steps):
        _step(model, dl, step, comm.rank)
    _, with_adam = _build(comm, reducer="dense")
    try:
        with_adam.load_state_dict(blob["diloco"])
        refused = None
    except ValueError as e:
        refused = str(e)
    return torch.equal(straight, _flat(model)), refused


def test_a_version_1_state_resumes_bitwise_with_the_default_outer_optimizer():
    """A state without world size and rank, its outer momentum one flat buffer (the previous format):
    loaded with the default outer SGD the run resumes bitwise (the buffer split exactly into the
    parameters' pieces); with a caller's Adam it is refused in one line."""
    for same, refused in ss.run_local(_resume_v1, 2, backend="thread"):
        assert same
        assert refused is not None and "\n" not in refused and "sparsync-diloco/1" in refused
