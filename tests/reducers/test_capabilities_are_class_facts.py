"""Reducer capabilities are facts of the class: never assigned on an instance, never probed.

A capability that a constructor option decides is an :class:`~sparsync.reducers.capabilities.OptionFact`:
the class reads its default instance's ``bool``, an instance the rule on its options.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sparsync as ss
from sparsync.reducers.base import CAPABILITIES
from sparsync.reducers.registry import load_all

SRC = Path(__file__).resolve().parents[2] / "src" / "sparsync"


def _capability_assignments(root: Path = SRC) -> list[str]:
    """``path:line`` of every assignment to an attribute named like a capability (``x.conserving = ...``)."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr in CAPABILITIES:
                        hits.append(f"{path.relative_to(root).as_posix()}:{node.lineno}: {ast.unparse(node)[:90]}")
    return hits


def test_no_module_assigns_a_capability_on_an_instance():
    hits = _capability_assignments()
    assert not hits, "capabilities assigned on instances:\n" + "\n".join(hits)


def test_ddp_probes_nothing():
    """``ddp.py`` reads declared attributes (its own and the reducers'), no ``getattr``/``hasattr``."""
    tree = ast.parse((SRC / "ddp.py").read_text())
    probes = [node.lineno for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr")]
    assert not probes, f"ddp.py probes attributes at lines {probes}"


@pytest.mark.parametrize("name, options, on_class, on_instance", [
    ("gtopk", {}, False, False),
    ("gtopk", {"residuals": "global"}, False, True),
    ("spardl", {"residuals": "partial"}, True, False),
    ("spardl", {}, True, True),
    ("s2", {"sketch_feedback": True}, False, True),
    ("topka", {"ef_decay": 0.5}, True, False),
    ("topka", {"value_bits": 4}, True, False),
    ("sparseloco", {"value_bits": 16, "ef_decay": 1.0}, False, True),
    ("micro", {"value_dtype": "fp16", "values": "allreduce"}, True, False),
    ("micro", {"value_dtype": "fp16", "values": "gather"}, True, True),
    ("dense", {"value_dtype": "bf16"}, True, False),
    ("cltk", {"value_dtype": "fp16"}, True, False),
    ("hier", {"outer": "gtopk"}, True, False),
])
def test_option_facts(name, options, on_class, on_instance):
    cls = load_all().lookup(name)
    assert cls.conserving is on_class

    def build(comm):
        r = ss.make_reducer(name, comm, density=0.1, **options)
        assert "conserving" not in vars(r)
        with pytest.raises(AttributeError, match="fact of the class"):
            r.conserving = not on_instance
        return r.conserving

    assert ss.run_local(build, 2, backend="thread") == [on_instance, on_instance]


def test_reuse_buffers_is_the_option_on_the_instance():
    def build(comm):
        rows = []
        for name in ("micro", "cltk", "hard_threshold"):
            r = ss.make_reducer(name, comm, density=0.1, reuse_buffers=False)
            assert load_all().lookup(name).reuse_buffers is True and "reuse_buffers" not in vars(r)
            rows.append((r.reuse_buffers, r.memory.in_place))
        return rows

    assert ss.run_local(build, 1, backend="thread")[0] == [(False, False)] * 3
