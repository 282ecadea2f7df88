"""The house stays livable (issue 55): no class in k3c/ longer than 400 lines, no function longer than 100, the
serving Engine a facade of about 300. Lines as ast counts them, from the first decorator to the last line."""
from __future__ import annotations

import ast
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_CLASS, MAX_FUNCTION, MAX_ENGINE = 400, 100, 320


def _span(node: ast.AST) -> int:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def too_long(root: pathlib.Path) -> list[str]:
    """'path:line: class|function NAME is N lines (at most M)' for every class or function over its limit."""
    out = []
    for path in sorted((root / "k3c").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                kind, limit = "class", MAX_CLASS
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind, limit = "function", MAX_FUNCTION
            else:
                continue
            n = _span(node)
            if n > limit:
                out.append(f"{path.relative_to(root)}:{node.lineno}: {kind} {node.name} is {n} lines "
                           f"(at most {limit})")
    return out


def test_no_class_or_function_is_too_long():
    found = too_long(ROOT)
    assert found == [], "\n".join(found)


def test_the_engine_is_a_facade():
    tree = ast.parse((ROOT / "k3c/runtime/serving/engine.py").read_text(encoding="utf-8"))
    [engine] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert _span(engine) <= MAX_ENGINE, f"Engine is {_span(engine)} lines: move what is not a facade into a room"


def test_the_check_sees_what_is_too_long(tmp_path):
    (tmp_path / "k3c").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))          # def line + 100 = 101 lines
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS // 3 + 1))
    (tmp_path / "k3c" / "big.py").write_text(f"def long():\n{body}\n\n\nclass Big:\n{methods}\n"
                                             + textwrap.dedent("""
                                                 def short():
                                                     return 1
                                                 """))
    found = too_long(tmp_path)
    assert len(found) == 2, found
    assert "function long is 101 lines" in found[0] and "class Big is" in found[1]
