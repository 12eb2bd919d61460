"""svmlight/libsvm loader: parsing, label mapping, and clear errors with the line number."""

import pytest
import torch

from sparsync.linear import SvmlightError, load_svmlight, make_synthetic
from sparsync.linear.data import save_svmlight


def _write(tmp_path, text, name="d.svm"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_parse_basic(tmp_path):
    p = _write(tmp_path, "# header comment\n+1 1:0.5 3:2 # tail\n\n-1 qid:3 2:1.5\n1 4:1e-3\n")
    ds = load_svmlight(p)
    assert ds.n_samples == 3 and ds.n_features == 4
    assert ds.labels.tolist() == [1.0, -1.0, 1.0]
    assert ds.indptr.tolist() == [0, 2, 3, 4]
    assert ds.indices.tolist() == [0, 2, 1, 3]
    assert torch.allclose(ds.values, torch.tensor([0.5, 2.0, 1.5, 1e-3]))
    ds0 = load_svmlight(_write(tmp_path, "0 0:1\n1 5:2\n", "z.svm"), zero_based=True, n_features=10)
    assert ds0.labels.tolist() == [-1.0, 1.0] and ds0.n_features == 10 and ds0.indices.tolist() == [0, 5]


def test_roundtrip(tmp_path):
    ds = make_synthetic(50, 300, 6, seed=2)
    p = tmp_path / "s.svm"
    save_svmlight(ds, p)
    back = load_svmlight(p, n_features=300)
    assert torch.equal(back.indices, ds.indices) and torch.equal(back.labels, ds.labels)
    assert torch.allclose(back.values, ds.values)


@pytest.mark.parametrize("text,line,match", [
    ("1 1:2\n-1 3\n", 2, "index:value"),
    ("1 1:2\n-1 a:3\n", 2, "index:value"),
    ("1 1:2\n-1 2:x\n", 2, "index:value"),
    ("abc 1:2\n", 1, "label"),
    ("1 3:1 2:1\n-1 1:1\n", 1, "strictly increasing"),
    ("1 2:1 2:1\n-1 1:1\n", 1, "strictly increasing"),
    ("1 0:1\n-1 1:1\n", 1, "below 1"),
    ("1 1:1\n-1 1:nan\n", 2, "not finite"),
    ("1 1:1\n-1 2:1\n# ok\n2 1:1\n", 4, "third class"),
])
def test_malformed_lines(tmp_path, text, line, match):
    p = _write(tmp_path, text)
    with pytest.raises(SvmlightError, match=match) as ei:
        load_svmlight(p)
    assert f"{p}:{line}:" in str(ei.value)


def test_index_beyond_dimension(tmp_path):
    p = _write(tmp_path, "1 1:1\n-1 2:1 11:1\n")
    with pytest.raises(SvmlightError, match="beyond the declared dimension 10") as ei:
        load_svmlight(p, n_features=10)
    assert f"{p}:2:" in str(ei.value)
    assert load_svmlight(p, n_features=11).n_features == 11


def test_empty_and_single_class(tmp_path):
    for text in ("", "\n\n# only comments\n"):
        with pytest.raises(SvmlightError, match="no samples"):
            load_svmlight(_write(tmp_path, text))
    with pytest.raises(SvmlightError, match="two label values"):
        load_svmlight(_write(tmp_path, "1 1:1\n1 2:1\n"))


def test_cli_reports_bad_file(tmp_path, capsys):
    from sparsync.cli import main

    p = _write(tmp_path, "1 1:1\n-1 oops\n")
    assert main(["train-linear", "--data", str(p), "--backend", "thread"]) == 2  # the user's to fix: exit 2
    assert capsys.readouterr().err.startswith(f"sparsync train-linear: error: {p}:2:")
