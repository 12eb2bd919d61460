"""No reducer module imports another reducer's module: shared parts live in the non-reducer modules.

The modules of ``sparsync.reducers`` that are not reducers are named here explicitly; every other
module of the package is a reducer (registers one or more). The check parses each module's source
(``ast``: imports inside functions count too), so it needs no import of the modules themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sparsync.reducers as pkg
from sparsync.reducers.registry import REDUCERS

#: the package's modules that are not reducers: what every reducer may import
NON_REDUCERS = {"__init__", "base", "registry", "memory", "blockbase", "resume", "capabilities"}

PKG_DIR = Path(pkg.__file__).parent
MODULES = sorted(p.stem for p in PKG_DIR.glob("*.py"))
REDUCER_MODULES = [m for m in MODULES if m not in NON_REDUCERS]


def package_imports(source: str) -> set[str]:
    """Modules of ``sparsync.reducers`` that ``source`` (a module of that package) imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import ... / from . import x
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
            elif node.level == 0 and node.module:
                parts = node.module.split(".")
                if parts[:2] == ["sparsync", "reducers"]:
                    if len(parts) > 2:
                        found.add(parts[2])
                    else:
                        found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[:2] == ["sparsync", "reducers"] and len(parts) > 2:
                    found.add(parts[2])
    return found


def registers(source: str) -> bool:
    """True when the module applies ``@register(...)`` to a class."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                if isinstance(f, ast.Name) and f.id == "register":
                    return True
    return False


def _source(mod: str) -> str:
    return (PKG_DIR / f"{mod}.py").read_text()


def test_the_check_sees_every_import_form():
    src = ("from .topka import X\nfrom . import micro\nimport sparsync.reducers.gtopk\n"
           "from sparsync.reducers.cltk import Y\nfrom sparsync.reducers import s2\n"
           "def f():\n    from .oktopk import Z\nfrom ..select import topk\n")
    assert package_imports(src) == {"topka", "micro", "gtopk", "cltk", "s2", "oktopk"}


def test_modules_are_classified():
    assert len(REDUCER_MODULES) >= 10
    assert NON_REDUCERS <= set(MODULES), "a named non-reducer module is gone: update NON_REDUCERS"
    # the registry imports every module but these (its skip list names the same modules)
    assert set(REDUCERS.skip) == NON_REDUCERS - {"__init__"}


@pytest.mark.parametrize("mod", sorted(NON_REDUCERS - {"__init__"}))
def test_non_reducer_modules_register_nothing(mod):
    assert not registers(_source(mod)), f"reducers/{mod}.py registers a reducer but is listed as a non-reducer"


@pytest.mark.parametrize("mod", REDUCER_MODULES)
def test_reducer_registers_and_imports_no_other_reducer(mod):
    src = _source(mod)
    assert registers(src), f"reducers/{mod}.py registers nothing: name it in NON_REDUCERS or register a reducer"
    others = sorted(package_imports(src) & set(REDUCER_MODULES) - {mod})
    assert not others, f"reducers/{mod}.py imports the reducer module(s) {others}: move the shared part out"
