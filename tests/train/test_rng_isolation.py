"""Library code never leaves the caller's global RNG re-seeded: the functions
that seed model construction do it inside ``torch.random.fork_rng`` (the caller's state comes back),
and their results do not depend on the caller's RNG state (runs stay reproducible)."""

import json
import textwrap

import torch

from sparsync.train.loop import launch, validate
from sparsync.train.runs import TrainConfig


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _after_noise(seed):
    """Put the global RNG in an arbitrary state (what a caller might have done) and return it."""
    torch.manual_seed(seed)
    torch.rand(7)
    return torch.get_rng_state()


def test_training_restores_the_callers_rng_and_ignores_it(tmp_path):
    def run(name, caller_seed):
        cfg = TrainConfig(workload="digits-mlp", workload_options={"width": 16}, reducer="dense", workers=2,
                          steps=3, eval_every=3, runs_dir=str(tmp_path), name=name, network="thread",
                          progress=False, timeout=60)
        validate(cfg)
        before = _after_noise(caller_seed)
        launch(cfg)
        assert torch.equal(torch.get_rng_state(), before)  # not re-seeded to cfg.seed
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows]

    assert run("a", 1) == run("b", 12345)  # bitwise: initial parameters from cfg.seed only


def test_plan_load_model_factory(tmp_path, monkeypatch):
    from sparsync.commands.plan import load_model

    (tmp_path / "rngfactory.py").write_text(textwrap.dedent("""
        import torch
        def make():
            return torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    """))
    monkeypatch.chdir(tmp_path)
    got = []
    for caller_seed in (3, 4):
        before = _after_noise(caller_seed)
        model, one = load_model("rngfactory:make", 5, input_shape="6")
        assert torch.equal(torch.get_rng_state(), before)
        got.append((_params(model), one().item()))
    (p1, l1), (p2, l2) = got
    assert all(torch.equal(a, b) for a, b in zip(p1, p2)) and l1 == l2  # lazy init and input seeded too


def test_bench_engine_build_and_reliability_case():
    from sparsync.bench.engine import build
    from faults_helpers import harness

    before = _after_noise(5)
    m1, _, _ = build("digits-mlp", 4)
    assert torch.equal(torch.get_rng_state(), before)
    _after_noise(6)
    m2, _, _ = build("digits-mlp", 4)
    assert all(torch.equal(a, b) for a, b in zip(_params(m1), _params(m2)))

    before = _after_noise(7)
    outcome, _ = harness._nonfinite_ddp()
    assert outcome == "clean error"
    assert torch.equal(torch.get_rng_state(), before)
