"""Sparse linear models: same weights for 1, 2, 4 workers (same global batch and seed), accuracy on
synthetic data well above chance, natural sparsity of the gradient, the train-linear CLI."""

import pytest
import torch

import sparsync as ss
from sparsync.linear import make_synthetic, train
from sparsync.linear.models import batch_gradient


@pytest.fixture(scope="module")
def data():
    ds = make_synthetic(4000, 20000, 20, seed=1)
    return ds.split(0.25, 0)


def _train(comm, tr, te, model, alg, dtype):
    return train(comm, tr.to(dtype), model, epochs=3, global_batch=200, lr=10.0, algorithm=alg, seed=2,
                 test_ds=te.to(dtype), dtype=dtype)


@pytest.mark.parametrize("model", ["logreg", "svm"])
def test_same_weights_for_1_2_4_workers(data, model):
    tr, te = data
    ws = {}
    for P, alg in [(1, "auto"), (2, "ssar_rec_dbl"), (4, "ssar_split_allgather"), (4, "dsar_early_switch")]:
        res = ss.run_local(_train, P, tr, te, model, alg, torch.float64)
        assert all(torch.equal(r["w"], res[0]["w"]) for r in res)  # bitwise identical on every rank
        ws[(P, alg)] = res[0]
    ref = ws[(1, "auto")]["w"]
    for key, r in ws.items():
        assert torch.allclose(r["w"], ref, rtol=1e-9, atol=1e-11), key
        assert r["history"][-1]["loss"] == pytest.approx(ws[(1, "auto")]["history"][-1]["loss"], rel=1e-9)


def test_float32_close_and_accuracy_above_chance(data):
    tr, te = data
    r1 = ss.run_local(_train, 1, tr, te, "logreg", "auto", torch.float32)[0]
    r4 = ss.run_local(_train, 4, tr, te, "logreg", "auto", torch.float32)[0]
    assert torch.allclose(r1["w"], r4["w"], rtol=1e-4, atol=1e-5)
    h = r4["history"]
    assert h[-1]["test_acc"] > 0.65 and h[-1]["train_acc"] > 0.7  # balanced classes: chance = 0.5
    assert h[-1]["loss"] < h[0]["loss"] < 0.6931  # below log(2), the loss at w = 0
    assert all(x["comm_s"] >= 0 and x["compute_s"] > 0 for x in h)
    assert h[0]["bytes_received"] > 0


@pytest.mark.gloo
def test_gloo_matches_thread(data):
    tr, te = data
    rt = ss.run_local(_train, 2, tr, te, "svm", "ssar_split_allgather", torch.float64)[0]
    rg = ss.run_local(_train, 2, tr, te, "svm", "ssar_split_allgather", torch.float64, backend="gloo")[0]
    assert torch.equal(rt["w"], rg["w"])


def test_gradient_is_naturally_sparse(data):
    tr, _ = data
    w = torch.randn(tr.n_features, generator=torch.Generator().manual_seed(0))
    rows = torch.arange(10)
    g = batch_gradient("logreg", tr, rows, w)
    support = set()
    for i in range(10):
        support |= set(tr.indices[tr.indptr[i]:tr.indptr[i + 1]].tolist())
    assert set(g.indices.tolist()) == support
    # dense reference of the summed logistic gradient
    X = torch.zeros(10, tr.n_features)
    for i in range(10):
        X[i, tr.indices[tr.indptr[i]:tr.indptr[i + 1]]] = tr.values[tr.indptr[i]:tr.indptr[i + 1]]
    y = tr.labels[:10]
    ref = (-(y / (1 + torch.exp(y * (X @ w))))[:, None] * X).sum(0)
    assert torch.allclose(g.to_dense(), ref, atol=1e-5)
    # SVM: only margin violators contribute
    gs = batch_gradient("svm", tr, rows, w)
    viol = (y * (X @ w)) < 1
    assert torch.allclose(gs.to_dense(), (-(y * viol)[:, None] * X).sum(0), atol=1e-5)


def test_synthetic_deterministic_and_bad_args():
    a = make_synthetic(200, 1000, 5, seed=4)
    b = make_synthetic(200, 1000, 5, seed=4)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.labels, b.labels)
    assert set(a.labels.unique().tolist()) == {-1.0, 1.0}
    with pytest.raises(ValueError):
        make_synthetic(1, 10, 1)
    with pytest.raises(ValueError, match="unknown model"):
        ss.run_local(lambda c: train(c, a, "ridge"), 1)
    with pytest.raises(ValueError, match="global_batch"):
        ss.run_local(lambda c: train(c, a, global_batch=1), 2)


def test_cli_train_linear(capsys):
    from sparsync.cli import main

    rc = main(["train-linear", "--data", "synthetic", "--samples", "2000", "--features", "5000",
               "--workers", "2", "--backend", "thread", "--epochs", "2", "--algorithm", "auto"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "epoch" in out and "comm s" in out and "auto:" in out
    assert len([ln for ln in out.splitlines() if ln.strip().startswith(("1 ", "2 "))]) == 2
    assert main(["train-linear", "--algorithm", "nope", "--backend", "thread"]) == 2


def test_linear_regression_gradient_training_and_real_targets(data, tmp_path):
    """Squared loss: gradient ``sum (w.x - y) x`` against a dense reference; SGD lowers the loss and
    gives the same weights on 1 and 4 workers; an svmlight file with real targets loads as regression."""
    tr, te = data
    w = torch.randn(tr.n_features, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.1
    rows = torch.arange(7)
    X = torch.zeros(7, tr.n_features, dtype=torch.float64)
    for i in range(7):
        X[i, tr.indices[tr.indptr[i]:tr.indptr[i + 1]]] = tr.values[tr.indptr[i]:tr.indptr[i + 1]].double()
    y = tr.labels[:7].double()
    g = batch_gradient("linreg", tr.to(torch.float64), rows, w)
    assert torch.allclose(g.to_dense(), ((X @ w - y)[:, None] * X).sum(0), atol=1e-12)
    r1 = ss.run_local(_train, 1, tr, te, "linreg", "auto", torch.float64)[0]
    r4 = ss.run_local(_train, 4, tr, te, "linreg", "ssar_split_allgather", torch.float64)[0]
    assert torch.allclose(r1["w"], r4["w"], rtol=1e-9, atol=1e-11)
    h = r4["history"]
    assert h[-1]["loss"] < h[0]["loss"] and h[-1]["test_acc"] > 0.6
    f = tmp_path / "reg.svm"
    f.write_text("0.5 1:1 3:2\n-1.25 2:1\n3 1:0.5\n")
    from sparsync.linear import load_svmlight

    ds = load_svmlight(f, regression=True)
    assert ds.labels.tolist() == [0.5, -1.25, 3.0]
    with pytest.raises(Exception, match="third class"):
        load_svmlight(f)
