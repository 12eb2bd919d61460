"""Every write into a residual happens in ``reducers/memory.py`` (:class:`sparsync.reducers.memory.ErrorFeedback`).

A reducer tells its memory what was sent and what came back (``keep``, ``put_back``, ``hold``,
``drain``); it never computes a residual itself. This test reads the source of ``src/sparsync`` (the
syntax tree, so docstrings and comments do not count) and fails on *residual arithmetic* anywhere
but ``memory.py``. Inside one function, a *residual name* is a name containing ``residual`` or one
bound to a ``.residual`` attribute (``pending = self.memory.residual``); an *accumulator* is a name
bound to ``memory.add(...)`` / ``memory.drain(...)``, or a parameter named ``acc``. Residual arithmetic is:

* a binary arithmetic operation or an augmented assignment with a residual name or ``.residual`` as
  an operand or target (``grad + pending``, ``full[lo:hi] += res``);
* an in-place method (``x.add_``, ``x.index_add_``, ``x.index_fill_``, ...) called on a residual name,
  ``.residual`` or an accumulator, or ``add_at`` / ``set_at`` with one of them as the target
  (``add_at(acc, idx, vals)``: a put-back computed by the reducer);
* an item assignment into a residual name or an accumulator (``acc[idx] = 0``);
* ``memory.keep(x)`` where ``x`` is not an accumulator (a residual the reducer computed elsewhere).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "sparsync"

#: files not checked, each with its reason
EXCEPTIONS = {
    "reducers/memory.py": "the one place residuals are written",
}

_WRITERS = {"add_at", "set_at"}
_INPLACE_OK = {"requires_grad_", "share_memory_"}


def _name(node) -> str | None:
    """``x`` for ``x``, ``x[...]``, ``x.view(...)``-free names only; None otherwise."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_residual_attr(node) -> bool:
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr in ("residual", "_residual")


def _memory_call(node, method: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "memory")


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path, self.hits = path, []
        self.residual: set[str] = set()
        self.acc: set[str] = set()

    def _hit(self, node, what):
        self.hits.append(f"{self.path}:{node.lineno}: {what}: {ast.unparse(node)[:100]}")

    def _is_residual(self, node) -> bool:
        name = _name(node)
        return _is_residual_attr(node) or (name is not None and ("residual" in name or name in self.residual))

    def _is_acc(self, node) -> bool:
        return _name(node) in self.acc

    def visit_FunctionDef(self, node):
        saved = self.residual, self.acc
        self.residual, self.acc = set(), {a.arg for a in node.args.args if a.arg == "acc"}
        for sub in ast.walk(node):  # bindings first: a name bound anywhere in the function counts
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
                target, value = sub.targets[0].id, sub.value
                if _is_residual_attr(value):
                    self.residual.add(target)
                if _memory_call(value, "add") or _memory_call(value, "drain"):
                    self.acc.add(target)
        self.generic_visit(node)
        self.residual, self.acc = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_BinOp(self, node):
        if self._is_residual(node.left) or self._is_residual(node.right):
            self._hit(node, "arithmetic on a residual")
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        if self._is_residual(node.target) or self._is_residual(node.value) or self._is_acc(node.target):
            self._hit(node, "augmented assignment on a residual")
        self.generic_visit(node)

    def visit_Assign(self, node):
        for t in node.targets:
            if isinstance(t, ast.Subscript) and (self._is_residual(t) or self._is_acc(t)):
                self._hit(node, "item assignment into a residual")
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Name) and f.id in _WRITERS and node.args and (
                self._is_residual(node.args[0]) or self._is_acc(node.args[0])):
            self._hit(node, f"{f.id} into a residual")
        if (isinstance(f, ast.Attribute) and f.attr.endswith("_") and not f.attr.startswith("_")
                and f.attr not in _INPLACE_OK and (self._is_residual(f.value) or self._is_acc(f.value))):
            self._hit(node, "in-place op on a residual")
        if _memory_call(node, "keep") and node.args and not (
                self._is_acc(node.args[0]) or _memory_call(node.args[0], "add")):
            self._hit(node, "memory.keep of a residual computed outside the memory")
        self.generic_visit(node)


def residual_arithmetic(root: Path = SRC, exceptions=EXCEPTIONS) -> list[str]:
    """Every place under ``root`` that writes a residual outside the exceptions (``path:line: what``)."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in exceptions:
            continue
        finder = _Finder(rel)
        finder.visit(ast.parse(path.read_text(), filename=rel))
        hits += finder.hits
    return hits


def test_residuals_are_written_only_by_the_memory():
    hits = residual_arithmetic()
    assert not hits, "residual arithmetic outside reducers/memory.py:\n" + "\n".join(hits)


def test_every_exception_exists():
    for rel in EXCEPTIONS:
        assert (SRC / rel).is_file(), rel


def test_the_grep_sees_each_form(tmp_path):
    """Each form of the module docstring is found (and a memory call is not)."""
    (tmp_path / "m.py").write_text(
        "def f(self, grad, idx, vals):\n"
        "    acc = self.memory.add(grad)\n"
        "    pending = self.memory.residual\n"
        "    x = grad + pending\n"                      # arithmetic
        "    add_at(acc, idx, vals)\n"                  # put-back by the reducer
        "    acc.index_add_(0, idx, vals, alpha=-1)\n"  # in-place
        "    acc[idx] = 0\n"                            # item assignment
        "    res = work.finish()\n"
        "    self.memory.keep(res)\n"                   # a residual computed elsewhere
        "    self.memory.keep(acc, idx)\n"              # fine
        "    self.memory.put_back(idx, vals)\n")        # fine
    hits = residual_arithmetic(tmp_path, {})
    assert [h.split(": ")[1] for h in hits] == [
        "arithmetic on a residual", "add_at into a residual", "in-place op on a residual",
        "item assignment into a residual", "memory.keep of a residual computed outside the memory"], hits


def test_what_the_reducer_hands_back_keeps_inputs_equal_to_sent_plus_residual():
    """``put_back``, ``hold``, ``keep`` with a decode and ``drain``: the residual the memory writes,
    bit for bit."""
    import torch

    from sparsync.reducers.memory import ErrorFeedback

    g = torch.linspace(-3, 3, 11)
    m = ErrorFeedback()
    acc = m.add(g)
    idx = torch.tensor([1, 4, 9])
    vals, sent = m.take(acc, idx)
    m.put_back(idx[:2], vals[:2])  # two of the three were not sent in the end
    assert torch.equal(m.residual + torch.zeros(11).index_put_((idx[2:],), sent[2:]), g)
    m.hold(torch.tensor([0]), torch.tensor([7.0]))  # what a collective left here
    assert float(m.residual[0]) == 7.0

    m = ErrorFeedback()
    acc = m.add(g)
    dec = torch.tensor([-2.5, 0.5])  # a quantised value's decode
    idx = torch.tensor([0, 6])
    old = acc.index_select(0, idx)
    m.keep(acc, idx, dec, acc_vals=old)
    assert torch.equal(m.residual.index_select(0, idx), old - dec)

    m = ErrorFeedback()
    assert m.drain(g) is g  # nothing pending: no pass
    m.residual = torch.ones(11)
    assert torch.equal(m.drain(g), g + 1) and m.residual is None
