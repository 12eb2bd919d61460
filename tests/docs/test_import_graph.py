"""The package's import graph has no circle and no import from a lower layer to a higher one.

The graph is read from the sources with :mod:`ast` (nothing is imported): an edge for every import of
a sparsync module, at module level or inside a function, relative (``from ..x import y``) or absolute
(``sparsync.x``). A package's node is its ``__init__.py`` (``sparsync.cluster``); importing ``a.b.c``
runs ``a/__init__.py`` and ``a/b/__init__.py`` first, so it is an edge to each of those packages too,
except to a package that holds the importer (it is already running then). The root package imports
its public names on first use (``_LAZY`` in ``sparsync/__init__.py``): those are its edges.

The layers are the ```text block under "Import layers" in docs/architecture.md, top layer first: a
layer's name, then the modules it holds (names under ``sparsync``; ``sparsync`` itself is the root
package; a package stands for everything in it, the longest name that matches a module wins). A
module may import its own layer and the layers below it; the rule is on the graph, not on a list of
modules, so a new module only needs a layer (its package's, or a line of the block).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sparsync"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


# ------------------------------------------------------------------------------------- the graph
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py")) if "__pycache__" not in p.parts}


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """``(module, name)`` pairs a statement of ``module`` imports from sparsync (``name`` None: the module
    itself); absolute imports of other packages give nothing."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name == "sparsync" or a.name.startswith("sparsync.")]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source != "sparsync" and not source.startswith("sparsync."):
        return []
    return [(source, a.name) for a in node.names]


def _target(source: str, name: str | None, modules) -> str:
    """The module an import runs: ``source.name`` when that is a module, else the longest module that
    ``source`` starts with."""
    if name is not None and f"{source}.{name}" in modules:
        return f"{source}.{name}"
    while source not in modules and "." in source:
        source = source.rpartition(".")[0]
    return source


def _lazy_names(path: Path) -> list[tuple[str, int]]:
    """The submodules the root package's ``_LAZY`` table imports on first use, with their line."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return [(v.value, v.lineno) for v in node.value.values if isinstance(v, ast.Constant)]
    return []


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, dict[str, str]]:
    """``{module: {imported module: "path:line" of the first import}}`` over every module of the package."""
    modules = _modules() if modules is None else modules
    graph: dict[str, dict[str, str]] = {m: {} for m in modules}

    def add(m: str, target: str, where: str) -> None:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # the packages on the way run first
            t = ".".join(parts[:i])
            if t == target or (t in modules and not (m == t or m.startswith(t + "."))):
                if t != m:
                    graph[m].setdefault(t, where)

    for m, path in modules.items():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for source, name in _imported(m, path.name == "__init__.py", node):
                    add(m, _target(source, name, modules), f"{rel}:{node.lineno}")
        if m == "sparsync":
            for sub, line in _lazy_names(path):
                add(m, _target(f"sparsync.{sub}", None, modules), f"{rel}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One circle of the graph as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


# ------------------------------------------------------------------------------------- the layers
def declared_layers(text: str | None = None) -> list[tuple[str, list[str]]]:
    """``[(layer, [module, ...]), ...]``, top first, from docs/architecture.md's "Import layers" block."""
    text = ARCHITECTURE.read_text(encoding="utf-8") if text is None else text
    m = re.search(r"^#+ Import layers\b.*?^```text\n(.*?)^```", text, flags=re.M | re.S)
    assert m, "docs/architecture.md has no ```text block under an 'Import layers' heading"
    layers = []
    for line in m.group(1).splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            layers.append((words[0], words[1:]))
    return layers


def _rank_of(layers) -> dict[str, tuple[int, str]]:
    """``{"sparsync.x": (height, layer)}``: 0 for the bottom layer."""
    return {("sparsync" if name == "sparsync" else f"sparsync.{name}"): (len(layers) - 1 - i, layer)
            for i, (layer, names) in enumerate(layers) for name in names}


def layer_of(module: str, rank_of) -> tuple[int, str] | None:
    """The layer of the longest declared name that ``module`` is or lies in (the root counts only for itself)."""
    parts = module.split(".")
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in rank_of:
            return rank_of[".".join(parts[:i])]
    return rank_of.get(module) if module == "sparsync" else None


# ------------------------------------------------------------------------------------- the tests
def test_the_reader_sees_every_kind_of_import():
    graph = import_graph()
    assert "sparsync.commhook" in graph["sparsync.ddp"]                 # module level, relative
    assert "sparsync.train.loop" in graph["sparsync.commands.train"]    # inside a function, two dots
    assert "sparsync.train" in graph["sparsync.commands.train"]         # the package on the way
    assert "sparsync.native" in graph["sparsync.select.exact"]          # from .. import <module>
    assert "sparsync.cluster" not in graph["sparsync.cluster.links"]    # its own package is running already
    assert "sparsync.ddp" in graph["sparsync"]                          # the root's lazy names
    modules = {"sparsync": SRC / "__init__.py", "sparsync.a": SRC / "a" / "__init__.py",
               "sparsync.a.b": SRC / "a" / "b.py", "sparsync.c": SRC / "c.py"}
    absolute = ast.parse("import sparsync.a.b as ab\nfrom sparsync.c import thing\nimport torch").body
    assert [_target(s, n, modules) for node in absolute for s, n in _imported("sparsync.c", False, node)] == \
        ["sparsync.a.b", "sparsync.c"]
    relative = ast.parse("from . import b\nfrom .. import c\nfrom ..c import thing").body
    assert [_target(s, n, modules) for node in relative for s, n in _imported("sparsync.a.b", False, node)] == \
        ["sparsync.a.b", "sparsync.c", "sparsync.c"]


def test_find_cycle_names_the_circle():
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {}}) is None
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"b": ""}}) == ["b", "c", "b"]


def test_no_import_circle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, ("import circle: " + " -> ".join(
        f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}. Move the shared helper "
        "to the module that owns it (the lower layer), not into a function-level import")


def test_the_layers_name_modules_that_exist():
    layers = declared_layers()
    assert len(layers) >= 5
    modules = _modules()
    names = [n for _, ns in layers for n in ns]
    assert len(names) == len(set(names)), "a module is named in two layers"
    stale = [n for n in names if ("sparsync" if n == "sparsync" else f"sparsync.{n}") not in modules]
    assert stale == [], f"docs/architecture.md's import layers name modules that do not exist: {stale}"


def test_every_module_has_a_layer():
    rank_of = _rank_of(declared_layers())
    missing = sorted(m for m in _modules() if layer_of(m, rank_of) is None)
    assert missing == [], (f"modules in no layer: {missing}; add each (or its package) to the 'Import layers' "
                           "block of docs/architecture.md")


def test_no_import_from_a_lower_layer_to_a_higher_one():
    rank_of = _rank_of(declared_layers())
    graph = import_graph()
    up = []
    for a, targets in sorted(graph.items()):
        la = layer_of(a, rank_of)
        for b, where in sorted(targets.items()):
            lb = layer_of(b, rank_of)
            if la is not None and lb is not None and lb[0] > la[0]:
                up.append(f"{a} ({la[1]}) imports {b} ({lb[1]}) at {where}")
    assert up == [], ("imports from a lower layer to a higher one (docs/architecture.md, Import layers): "
                      + "; ".join(up))


@pytest.mark.parametrize("text,expected", [
    ("## Import layers\n\n```text\ntop   a b   # comment\n\nlow   c\n```\n", [("top", ["a", "b"]), ("low", ["c"])]),
])
def test_the_layer_block_is_read(text, expected):
    assert declared_layers(text) == expected
    rank_of = _rank_of(expected)
    assert layer_of("sparsync.a.x", rank_of) == (1, "top") and layer_of("sparsync.c", rank_of) == (0, "low")
    assert layer_of("sparsync.d", rank_of) is None and layer_of("sparsync", rank_of) is None
