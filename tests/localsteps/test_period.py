"""``DiLoCo(sync_every="auto")``: the period minimises the modelled time to target, every rank takes the
same period from different local timings, it follows a link that gets faster, a checkpoint in the
middle of a cycle resumes bitwise (period included), and the CLI runs it and reports where it changed.
Real thread ranks; times injected where a test needs them."""

import io
import json

import pytest
import torch

import sparsync as ss
from diloco_helpers import classify_step
from sparsync.localsteps.period import START_PERIOD, AutoPeriod, best_period, default_period_cost
from sparsync.threadcomm import ThreadWorld


def _time_to_target(H, t_c, t_s, c):
    return (1 + c * (H - 1)) * (t_c + t_s / H)


@pytest.mark.parametrize("t_c,t_s,c", [(0.05, 0.2, 0.02), (0.05, 0.001, 0.02), (0.01, 2.0, 0.05), (0.1, 0.1, 0.5),
                                       (0.02, 0.3, 0.001), (0.05, 0.0, 0.02), (0.05, 0.2, 0.0)])
def test_best_period_is_the_argmin_of_the_modelled_time(t_c, t_s, c):
    brute = min(range(1, 65), key=lambda H: (_time_to_target(H, t_c, t_s, c), H))
    got = best_period(t_c, t_s, c, 64)
    assert _time_to_target(got, t_c, t_s, c) == pytest.approx(_time_to_target(brute, t_c, t_s, c), rel=1e-12)
    if t_s == 0:
        assert got == 1
    if c == 0 and t_s > 0:
        assert got == 64


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return m


def _inject(dl, rank):
    """Local steps take 10 ms on every rank; a synchronisation 50 ms x (rank + 1) (the slowest rank:
    200 ms) until the 3rd, then 1 ms: the link got fast."""
    def hook(ev):
        if ev["event"] == "step":
            return {**ev, "seconds": 0.010}
        return {**ev, "seconds": 0.05 * (rank + 1) if dl.outer_step < 3 else 0.001}
    return hook


def _build(comm, seed=0, **opts):
    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    dl = ss.DiLoCo(model, comm, opt, sync_every="auto", reducer="micro", density=0.1, **opts)
    dl.auto_period.timings = _inject(dl, comm.rank)
    return model, opt, dl


def _periods(comm, steps=120):
    model, _, dl = _build(comm)
    for step in range(steps):
        classify_step(model, dl, step, comm.rank)
    return dl.periods, dl.groups[0].shared.clone()  # (the module holds this rank's local parameters)


def test_every_rank_takes_the_same_period_and_it_follows_the_link():
    res = ss.run_local(_periods, 4, backend="thread")
    periods, params = res[0]
    assert all(p == periods and torch.equal(x, params) for p, x in res)
    H = [p["sync_every"] for p in periods]
    # the first synchronisation after START_PERIOD local steps: sqrt(0.98 * 0.2 / (0.02 * 0.01)) = 31.3
    # from the slowest rank's 200 ms (rank 0 alone would say 16); once the median of the last three
    # synchronisations is the fast link's: sqrt(0.98 * 0.001 / 0.0002) = 2.2
    assert periods[0]["outer_step"] == 1 and H[0] == best_period(0.01, 0.2, 0.02) == 31, periods
    assert periods[0]["sync_ms"] == pytest.approx(200.0) and periods[0]["compute_ms"] == pytest.approx(10.0)
    assert [p["sync_every"] for p in periods if p["outer_step"] == 3] == [31], periods  # one fast sync: the median
    late = [p["sync_every"] for p in periods if p["outer_step"] >= 4]
    assert late and all(h == best_period(0.01, 0.001, 0.02) == 2 for h in late), periods


def _resume(comm, steps=70, cut=37):
    model, _, dl = _build(comm)
    for step in range(steps):
        classify_step(model, dl, step, comm.rank)
    straight, periods = torch.cat([p.detach().reshape(-1) for p in model.parameters()]), dl.periods

    model, opt, dl = _build(comm)
    for step in range(cut):
        classify_step(model, dl, step, comm.rank)
    assert 0 < dl.inner_step < dl.sync_every and dl.sync_every > 1, (dl.inner_step, dl.sync_every)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": dl.state_dict()}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    model, opt, dl = _build(comm, seed=5)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["opt"])
    dl.load_state_dict(blob["diloco"])
    for step in range(cut, steps):
        classify_step(model, dl, step, comm.rank)
    return torch.equal(straight, torch.cat([p.detach().reshape(-1) for p in model.parameters()])), periods == dl.periods


def test_resume_in_the_middle_of_an_auto_period_is_bitwise():
    assert all(same and periods for same, periods in ss.run_local(_resume, 2, backend="thread"))


def test_options_and_state_mismatches_are_refused():
    c = ThreadWorld(1).comms()[0]
    m = _model()
    sgd, adamw = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.AdamW(m.parameters())
    assert default_period_cost(sgd) == 0.02 and default_period_cost(adamw) == 0.05
    for bad, msg in (({"sync_every": "sometimes"}, "sync_every"),
                     ({"sync_every": 4, "period_cost": 0.1}, "'auto' only"),
                     ({"sync_every": "auto", "period_cost": 1.5}, "period_cost"),
                     ({"sync_every": "auto", "max_period": 0}, "max_period")):
        with pytest.raises(ValueError, match=msg):
            ss.DiLoCo(m, c, sgd, **bad)
    sd = ss.DiLoCo(m, c, sgd, sync_every="auto").state_dict()
    with pytest.raises(ValueError, match="sync_every=auto"):
        ss.DiLoCo(m, c, sgd, sync_every=4).load_state_dict(sd)
    with pytest.raises(ValueError, match="period_cost"):
        AutoPeriod(c, -0.1)


def test_train_cli_sync_every_auto(tmp_path):
    from sparsync.cli import main

    rc = main(["train", "--thread", "--workers", "2", "--reducer", "micro", "--density", "0.05", "--sync-every",
               "auto", "--steps", "12", "--eval-every", "6", "--runs-dir", str(tmp_path), "--name", "p",
               "--no-progress"])
    assert rc in (0, None)
    rows = [json.loads(line) for line in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["sync_every"] == START_PERIOD and all(r["sync_every"] >= 1 for r in rows)
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert all(c["sync_every"] >= 1 for c in summary.get("sync_every_changes", [{"sync_every": 1}]))


def test_compare_syntax_takes_sync_every_auto():
    from sparsync.commands.compare import parse_configs
    from sparsync.localsteps import trainer as local
    from sparsync.train.runs import TrainConfig

    (c,) = parse_configs("micro:0.05,sync_every=auto,period_cost=0.05", 0.01, "single")
    assert c["local"] == {"sync_every": "auto", "period_cost": 0.05}
    cfg = TrainConfig(reducer="micro", local_steps={"sync_every": 4, "max_period": 8})
    with pytest.raises(ValueError, match="sync_every=auto only"):
        local.check(cfg)
