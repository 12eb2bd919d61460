"""The word-level language model trains (loss falls) on 4 workers with dense, spardl and s2, the
latter with a sparse (``Embedding(sparse=True)``) embedding."""

import pytest

from sparsync.reducers.registry import load_all
from sparsync.train.loop import launch, validate
from sparsync.train.runs import TrainConfig
from sparsync.train.workloads import lm_corpus, make_workload

TINY = {"vocab": 2000, "dim": 16, "context": 3, "hidden": 32, "n_test": 512}
CASES = [("dense", True), ("spardl", False), ("s2", True)]


def test_corpus_is_deterministic_and_real():
    a, path = lm_corpus()
    b, _ = lm_corpus()
    assert a == b and len(a) > 200_000 and path.exists()
    assert {"def", "return", "self"} <= set(a[:50_000])  # Python standard library text
    wl = make_workload("lm", **TINY)
    assert wl.build().emb.weight.shape == (2000, 16)
    assert int(wl.x_train.max()) < 2000 and wl.y_train.min() >= 0


@pytest.mark.gloo
@pytest.mark.parametrize("reducer,sparse", CASES)
def test_lm_loss_falls(tmp_path, reducer, sparse):
    if reducer not in load_all():
        pytest.skip(f"reducer {reducer} is not registered in this tree yet")
    cfg = TrainConfig(workload="lm", workload_options={**TINY, "sparse_embedding": sparse}, reducer=reducer,
                      density=0.05, workers=4, steps=40, batch_size=32, optimizer="momentum", lr=0.5, eval_every=20,
                      runs_dir=str(tmp_path), name="lm", network="loopback", progress=False, timeout=120)
    validate(cfg)
    s = launch(cfg)
    losses = s["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.7, (reducer, sparse, first, last)  # nats; first ~ log(2000) = 7.6
    assert s["final_accuracy"] > 0.05


@pytest.mark.gloo
def test_linear_workload_learns(tmp_path):
    """SparCML's linear workload (sparse logistic regression) through the same loop, 4 workers."""
    pytest.importorskip("sparsync.linear")
    cfg = TrainConfig(workload="linear", workload_options={"n_samples": 4000, "n_features": 20000}, reducer="dense",
                      workers=4, steps=40, eval_every=20, runs_dir=str(tmp_path), name="lin", network="loopback",
                      progress=False, timeout=120)
    validate(cfg)
    s = launch(cfg)
    assert s["final_accuracy"] > 0.65 and s["losses"][-1] < s["losses"][0]
