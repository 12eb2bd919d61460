"""The ``gpt`` workload (decoder-only transformer, AdamW with warm-up + cosine) and the trainer's
lower-is-better target; :class:`sparsync.adam.FrozenVarianceAdamW` (1-bit Adam's frozen variance)."""

import json
import math

import pytest
import torch

from sparsync.adam import FrozenVarianceAdamW
from sparsync.cli import main
from sparsync.train.gpt import GPT
from sparsync.train.optim import COSINE_FLOOR, lr_factor
from sparsync.train.runs import TrainConfig
from sparsync.train.workloads import make_workload

TINY = {"width": 32, "layers": 1, "heads": 2, "context": 8, "max_words": 20000, "n_test": 64}


def test_model_is_causal():
    """Changing token t changes the logits at t and after, never before."""
    torch.manual_seed(0)
    m = GPT(vocab=27, width=32, layers=2, heads=4, context=12).eval()
    x = torch.randint(0, 27, (3, 12))
    y = x.clone()
    y[:, 7] = (y[:, 7] + 5) % 27
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])
    with pytest.raises(ValueError, match="longer than the context"):
        m(torch.zeros(1, 13, dtype=torch.long))


def test_workload_is_deterministic_given_the_seed():
    a, b = make_workload("gpt", **TINY), make_workload("gpt", **TINY)
    assert torch.equal(a.x_test, b.x_test) and torch.equal(a.y_test, b.y_test)
    assert torch.equal(a.x_train[:, 1:], a.y_train[:, :-1])  # the target is the input shifted by one
    assert int(a.x_train.max()) < 27 and a.x_train.shape[1] == 8
    for s in (0, 1):
        torch.manual_seed(s)
        pa = torch.cat([p.flatten() for p in a.build().parameters()])
        torch.manual_seed(s)
        pb = torch.cat([p.flatten() for p in b.build().parameters()])
        assert torch.equal(pa, pb)
    xa, ya = a.batch(5, 1, 4, 3, seed=7)
    xb, yb = b.batch(5, 1, 4, 3, seed=7)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, a.batch(5, 1, 4, 3, seed=8)[0])
    ev = a.evaluate(a.build())
    assert abs(ev["perplexity"] - math.exp(ev["loss"])) < 1e-6 * ev["perplexity"]
    assert 2.5 < ev["loss"] < 4.0  # an untrained model: about log(27) = 3.3 nats per character


@pytest.mark.parametrize("option,message", [("width=abc", "width='abc': expected an integer"),
                                            ("width=30,heads=4", "multiple of heads"),
                                            ("depth=2", "no option depth")])
def test_bad_workload_options_are_one_line_errors(tmp_path, capsys, option, message):
    code = main(["train", "--workload", "gpt", "--workload-option", option, "--thread", "--runs-dir", str(tmp_path),
                 "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err
    assert not any(tmp_path.iterdir())


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(t, 100, warmup=10, schedule="cosine") for t in range(100)]
    assert f[0] == pytest.approx(0.1) and f[4] == pytest.approx(0.5) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0)
    mid = 10 + (99 - 10) / 2
    assert lr_factor(mid, 100, 10, "cosine") == pytest.approx(COSINE_FLOOR + (1 - COSINE_FLOOR) / 2)
    assert f[99] == pytest.approx(COSINE_FLOOR)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # decays monotonically after the warm-up
    assert [lr_factor(t, 100, 3, "constant") for t in (0, 2, 3, 99)] == pytest.approx([1 / 3, 1, 1, 1])
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, 10, 0, "linear")


def test_tiny_gpt_trains_end_to_end_with_a_loss_target(tmp_path, capsys):
    """``sparsync train --workload gpt`` on 2 thread ranks: AdamW by default, the held-out loss falls,
    and the loss target (lower is better) is reached exactly when an evaluation is at or below it."""
    opts = ",".join(f"{k}={v}" for k, v in TINY.items())
    argv = ["train", "--workload", "gpt", "--workload-option", opts, "--workers", "2", "--thread", "--steps", "60",
            "--eval-every", "10", "--lr", "0.01", "--lr-warmup", "5", "--target-loss", "2.7",
            "--runs-dir", str(tmp_path), "--name", "g", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "held-out loss <= 2.7" in out and "perplexity" in out
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert cfg["optimizer"] == "adamw" and cfg["lr_schedule"] == "cosine" and cfg["weight_decay"] > 0
    s = json.loads((tmp_path / "g" / "summary.json").read_text())
    losses = [e["loss"] for e in s["evals"]]
    assert losses[-1] < min(losses[0] - 0.15, 2.7), losses  # untrained: ~3.3 nats; first evaluation at step 10
    first = next(e for e in s["evals"] if e["loss"] <= 2.7)
    before = [e for e in s["evals"] if e["step"] < first["step"]]
    assert s["time_to_target_eval_s"] == first["time_s"]  # the first evaluation at or below the target
    # interpolated between that evaluation and the one before it (a loss target: crossed going down)
    assert s["steps_to_target"] <= first["step"] + 1 and s["time_to_target_s"] <= first["time_s"]
    if before:
        assert s["steps_to_target"] >= before[-1]["step"] + 1 and s["time_to_target_s"] >= before[-1]["time_s"]
    assert s["final_perplexity"] == pytest.approx(math.exp(s["final_test_loss"]))
    rows = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert all("perplexity" in r for r in rows if "test_loss" in r)


def test_target_loss_replaces_the_workloads_accuracy_target():
    wl = make_workload("gpt", **TINY)
    cfg = TrainConfig(workload="gpt").fill_defaults(wl)
    assert cfg.target_accuracy is None and cfg.target_loss == wl.defaults["target_loss"]
    assert cfg.target_reached({"loss": cfg.target_loss, "accuracy": 0.0})
    assert not cfg.target_reached({"loss": cfg.target_loss + 1e-6, "accuracy": 1.0})
    acc = TrainConfig(workload="gpt", target_accuracy=0.5).fill_defaults(wl)
    assert acc.target_loss is None and acc.target_reached({"loss": 9.0, "accuracy": 0.5})


# ---------------------------------------------------------------------------- FrozenVarianceAdamW
def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def _grads(t):
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(6, 5, generator=g), torch.randn(5, generator=g)]


def _run(opt, params, steps, lrs=None):
    for t in range(steps):
        for p, g in zip(params, _grads(t)):
            p.grad = g.clone()
        if lrs is not None:
            for grp in opt.param_groups:
                grp["lr"] = lrs[t]
        opt.step()


def test_frozen_variance_off_is_adamw_bitwise():
    """Before ``freeze_after`` (here: never reached) it is torch's AdamW, bitwise, schedule included."""
    a, b = _params(), _params()
    lrs = [1e-2 * lr_factor(t, 30, 5, "cosine") for t in range(30)]
    _run(torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1), a, 30, lrs)
    _run(FrozenVarianceAdamW(b, lr=1e-2, weight_decay=0.1, freeze_after=1000), b, 30, lrs)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_frozen_variance_is_frozen_and_the_update_uses_it():
    ps = _params()
    opt = FrozenVarianceAdamW(ps, lr=1e-2, weight_decay=0.1, freeze_after=5)
    _run(opt, ps, 5)
    v5 = [opt.state[p]["exp_avg_sq"].clone() for p in ps]
    ref = _params()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    _run(ref_opt, ref, 5)
    assert all(torch.equal(x, y) for x, y in zip(ps, ref))  # plain AdamW up to the freeze
    before = [p.detach().clone() for p in ps]
    m = [opt.state[p]["exp_avg"].clone() for p in ps]
    grads = _grads(5)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    opt.step()
    for p, p0, g, m0, v in zip(ps, before, grads, m, v5):
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)  # never written again
        m1 = m0.lerp(g, 0.1)
        assert torch.equal(opt.state[p]["exp_avg"], m1)
        want = p0 * (1 - 1e-2 * 0.1) - 1e-2 / (1 - 0.9 ** 6) * m1 / (v.sqrt() / math.sqrt(1 - 0.999 ** 5) + 1e-8)
        assert torch.allclose(p.detach(), want, rtol=0, atol=1e-7)
        # and different from what AdamW would have done (its v moves)
    _run(ref_opt, ref, 1)
    assert not torch.equal(ref_opt.state[ref[0]]["exp_avg_sq"], v5[0])
    _run(opt, ps, 5)
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v) for p, v in zip(ps, v5))


def test_frozen_variance_resumes_bitwise_and_checks_its_argument():
    a = _params()
    oa = FrozenVarianceAdamW(a, lr=1e-2, freeze_after=3)
    _run(oa, a, 8)
    b = _params()
    ob = FrozenVarianceAdamW(b, lr=1e-2, freeze_after=3)
    _run(ob, b, 4)
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    oc = FrozenVarianceAdamW(c, lr=1e-2, freeze_after=3)
    oc.load_state_dict(ob.state_dict())
    for t in range(4, 8):
        for p, g in zip(c, _grads(t)):
            p.grad = g.clone()
        oc.step()
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    with pytest.raises(ValueError, match="freeze_after"):
        FrozenVarianceAdamW(_params(), freeze_after=0)


def test_dense_steps_send_everything_first_then_the_schedule():
    from sparsync.convergence import GradientPolicy, policy_from_options

    pol = policy_from_options({"dense_steps": 3, "warmup_steps": 6, "warmup_start": 0.5})
    d = [pol.density(t, 0.01) for t in range(8)]
    assert d[:3] == [1.0, 1.0, 1.0]
    assert d[3] == pytest.approx(0.5 * (0.01 / 0.5) ** 0.5) and d[6:] == [0.01, 0.01]
    assert [GradientPolicy().density(t, 0.01) for t in range(3)] == [0.01] * 3
    old = GradientPolicy().state_dict()
    del old["options"]["dense_steps"]  # a state saved before the option existed loads into the default
    GradientPolicy().load_state_dict(old)
    with pytest.raises(ValueError, match="dense_steps"):
        GradientPolicy(dense_steps=-1)
    with pytest.raises(ValueError, match="dense_steps"):
        GradientPolicy(dense_steps=3).load_state_dict(GradientPolicy().state_dict())


def test_compare_rows_take_adam_freeze():
    from sparsync.commands.compare import config_slug, parse_configs

    (c,) = parse_configs("micro:0.01,dense_steps=60,adam_freeze=60", 0.05, "single")
    assert c["train"] == {"adam_freeze": 60} and c["convergence"] == {"dense_steps": 60} and c["options"] == {}
    assert "adam_freeze60" in config_slug(c)
