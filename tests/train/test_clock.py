"""A row's clock is its slowest rank's, its evaluations see the model a user would keep, and every run
states its link ratio and compute utilisation."""

import json

import pytest
import torch
from torch import nn

import sparsync as ss
from sparsync.train import clock
from sparsync.train.config import TrainConfig
from sparsync.train.rows import ratio_and_utilisation
from sparsync.train.validation import validate


def _clock_and_model(comm):
    m = nn.Linear(3, 2)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):  # ranks 0..3 hold models that differ by their rank
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view_as(p) / 8 + i + comm.rank)
    avg = clock.kept_model(m, comm, local_steps=True, in_sync=False)
    same = clock.kept_model(m, comm, local_steps=True, in_sync=True)
    plain = clock.kept_model(m, comm, local_steps=False, in_sync=False)
    return (clock.slowest(comm, 1.0 + comm.rank), [p.detach().clone() for p in avg.parameters()],
            same is m and plain is m, [p.detach().clone() for p in m.parameters()], comm.ledger.bytes_sent)


def test_slowest_clock_and_the_average_model():
    res = ss.run_local(_clock_and_model, 4, backend="thread")
    assert [r[0] for r in res] == [4.0] * 4  # every rank takes the slowest rank's clock
    base = res[0][3]  # rank 0's: offset 0
    for r in res:
        assert r[2]  # no copy where every rank holds the same model, or without local steps
        assert all(torch.allclose(a, b + 1.5) for a, b in zip(r[1], base))  # mean of rank offsets 0..3
        assert r[4] == 0  # untimed and unrecorded: the ledger counts training traffic only


def test_ratio_and_utilisation_use_the_rounds_compute_for_rows_without_one():
    runs = [{"round": 0, "median_compute_s": 0.1, "allreduce_s": 0.4, "train_time_s": 20.0, "steps_run": 100},
            {"round": 0, "median_compute_s": None, "allreduce_s": 0.4, "train_time_s": 50.0, "steps_run": 100},
            {"round": 0, "median_compute_s": 0.3, "allreduce_s": None, "train_time_s": 30.0, "steps": 100}]
    got = ratio_and_utilisation(runs)
    r0, u0 = got[id(runs[0])]
    assert abs(r0 - 4.0) < 1e-12 and abs(u0 - 0.5) < 1e-12
    r1, u1 = got[id(runs[1])]  # torch DDP: the round's median compute (0.2)
    assert abs(r1 - 2.0) < 1e-12 and abs(u1 - 0.4) < 1e-12
    assert got[id(runs[2])] == (None, 1.0)


def test_a_diloco_row_reports_r_utilisation_and_evaluates_the_average(tmp_path):
    from sparsync.train.loop import launch

    c = TrainConfig(workload="digits-mlp", workload_options={"width": 64}, reducer="topka", density=0.05,
                    workers=2, steps=10, eval_every=5, runs_dir=str(tmp_path), name="d", network="thread",
                    progress=False, timeout=120, local_steps={"sync_every": 4})
    validate(c)
    s = launch(c)
    assert s["allreduce_s"] > 0 and s["link_ratio"] > 0 and 0 < s["utilisation"] <= 1
    assert s["steps_run"] == 10
    rows = [json.loads(x) for x in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "test_loss" in r] == [4, 9]


class _Evaluated:
    """A workload stand-in whose evaluation depends on the rank that runs it, counting the calls."""
    name = "probe"

    def __init__(self, keys=("accuracy", "loss")):
        self.calls, self.keys = [], keys

    def evaluate(self, model):
        self.calls.append(model.rank)
        return {k: 0.25 + model.rank + i for i, k in enumerate(self.keys)}


def _evaluate(comm, wl):
    return clock.evaluate_once(wl, type("M", (), {"rank": comm.rank})(), comm)


def test_only_rank_0_evaluates_and_every_rank_returns_its_numbers():
    wl = _Evaluated()
    got = ss.run_local(_evaluate, 3, wl, backend="thread")
    assert wl.calls == [0]
    assert got == [{"accuracy": 0.25, "loss": 1.25}] * 3  # no perplexity: this workload gives none
    wl = _Evaluated(("accuracy", "loss", "perplexity", "bleu"))
    with pytest.raises(Exception, match="bleu"):
        ss.run_local(_evaluate, 2, wl, backend="thread", timeout=30)
