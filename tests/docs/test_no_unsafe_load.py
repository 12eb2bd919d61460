"""No ``weights_only=False`` in the package: state read from files or gathered from peers is tensors
and plain data, loaded with ``weights_only=True`` (a crafted file or peer cannot run code). The one
place that unpickles objects - a launched rank's report to its own launcher over a pipe - does so by
name (``launch.failures.decode_report``)."""

import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "sparsync"


def test_no_module_loads_with_weights_only_false():
    hits = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"weights_only\s*=\s*False", line)]
    assert not hits, hits


def test_every_torch_load_says_weights_only():
    calls = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "torch.load(" in line and "``" not in line and "weights_only=True" not in line]
    assert not calls, calls
