"""``sparsync bench revision``: an earlier git revision's reducers beside the current ones."""

import subprocess

import pytest

from sparsync.bench.revision import OLD_PACKAGE, rename_imports, repository_root, run_revision_ab


def _have_git_checkout() -> bool:
    try:
        repository_root()
        subprocess.run(["git", "-C", str(repository_root()), "rev-parse", "HEAD"], check=True, capture_output=True)
        return True
    except (RuntimeError, subprocess.CalledProcessError):
        return False


def test_rename_imports_points_absolute_imports_at_the_old_package():
    src = ('"""Docs: see sparsync.reducers and\nimport sparsync in text."""\n'
           "import sparsync as ss\nfrom sparsync.sparse import SparseVec\ndef f():\n    from sparsync import comm\n"
           "import sparsync\nfrom .base import Reducer\nimport sparsync_other\n")
    out = rename_imports(src, "x.py")
    assert f"import {OLD_PACKAGE} as ss\n" in out
    assert f"from {OLD_PACKAGE}.sparse import SparseVec\n" in out
    assert f"    from {OLD_PACKAGE} import comm\n" in out
    assert f"import {OLD_PACKAGE} as sparsync\n" in out
    assert "from .base import Reducer\n" in out and "import sparsync_other\n" in out  # untouched
    assert out.startswith('"""Docs: see sparsync.reducers and\nimport sparsync in text."""')  # docstring kept
    multi = rename_imports("from sparsync.sparse import (\n    a,\n    b)\nx = 1\n")
    assert multi == f"from {OLD_PACKAGE}.sparse import a, b\n\n\nx = 1\n"  # line numbers kept
    assert rename_imports("import os, sparsync.train as st\n") == f"import os; import {OLD_PACKAGE}.train as st\n"
    with pytest.raises(ValueError, match=r"x\.py.*import sparsync\.reducers"):
        rename_imports("import sparsync.reducers\n", "x.py")


@pytest.mark.gloo
@pytest.mark.skipif(not _have_git_checkout(), reason="needs sparsync run from a git checkout")
def test_revision_ab_runs_both_versions_on_the_same_inputs():
    """HEAD against the working tree: both versions run on every rank with the same gradients, so
    the dense reducer (a plain all-reduce below the copy pipeline's size) gives the same bits."""
    rows = run_revision_ab("HEAD", "dense,micro", world_size=2, numel=50_000, steps=2, warmup=1)
    assert [r["reducer"] for r in rows] == ["dense", "micro"]
    for r in rows:
        assert r["old_s"] > 0 and r["new_s"] > 0 and r["ratio"] == pytest.approx(r["new_s"] / r["old_s"])
    assert rows[0]["same_result"]


def test_unknown_revision_is_named():
    if not _have_git_checkout():
        pytest.skip("needs a git checkout")
    with pytest.raises(ValueError, match="no-such-rev"):
        run_revision_ab("no-such-rev", "dense", world_size=1, numel=100, steps=1, warmup=0)
