"""Small modules with one idea each: a module of ``src/sparsync`` over :data:`LIMIT` lines says in its
docstring why it is one module, in a sentence that starts "One module because" (docs/architecture.md,
Conventions). :data:`ALLOWED` lists modules still waiting for that split or sentence; an entry that no
longer needs to be there fails too, so the list only shrinks."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "sparsync"
LIMIT = 450
REASON = "One module because"
#: over the limit with no reason yet (being edited elsewhere; to be split or given a reason)
ALLOWED: set[str] = set()


def _modules():
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _has_reason(path: Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return REASON.lower() in " ".join(doc.split()).lower()


def _name(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def test_the_package_is_found():
    names = {_name(p) for p in _modules()}
    assert {"__init__.py", "sparse.py", "cluster/__init__.py", "launch/__init__.py"} <= names


@pytest.mark.parametrize("path", [p for p in _modules() if _lines(p) > LIMIT and _name(p) not in ALLOWED], ids=_name)
def test_a_long_module_says_why_it_is_one(path):
    assert _has_reason(path), (f"{_name(path)} has {_lines(path)} lines (> {LIMIT}): split it by job, or say why it "
                               f"is one module in its docstring ('{REASON} ...')")


def test_the_allow_list_holds_only_modules_that_need_it():
    present = {_name(p): p for p in _modules()}
    stale = sorted(n for n in ALLOWED if n not in present or _lines(present[n]) <= LIMIT or _has_reason(present[n]))
    assert stale == [], f"remove from ALLOWED (gone, short enough, or given a reason): {stale}"
