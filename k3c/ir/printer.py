"""IR text printer: one line per op, MLIR-like. See docs/ir.md for the grammar; parser.py reads it back exactly.
It reads the fields of core.py's Op and Module (and their attribute values) without importing core.py, whose
`str()` of an op or a module is this text.

    module @k3-tiny attributes {hidden_size = 64} {
      %w3 = param() {name = "norm.weight"} : bf16[64] loc("examples/k3-tiny.yaml:7")
      %x4 = rmsnorm(%h2, %w3) {eps = 1e-05} : bf16[B, T, 64] loc("examples/k3-tiny.yaml:7")
      return %x4
    }
"""
from __future__ import annotations

import math
from typing import Any, Iterable

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def quote(s: str) -> str:
    """A double-quoted, ASCII-only string literal; anything else becomes \\u{hex}, so a line stays one line."""
    if s.isascii() and s.isprintable() and '"' not in s and "\\" not in s:
        return f'"{s}"'
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(f"\\u{{{ord(ch):x}}}")
    return '"' + "".join(out) + '"'


def format_float(v: float) -> str:
    """Shortest text that reads back to the same float (repr), with inf/nan spelled as IR keywords."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def format_scalar(v: Any) -> str:
    if v is None:
        return "none"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format_float(v)
    return quote(v)


def format_value(v: Any) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(format_scalar(x) for x in v) + "]"
    return format_scalar(v)


def format_attrs(attrs: Iterable[tuple[str, Any]]) -> str:
    return "{" + ", ".join(f"{k} = {format_value(v)}" for k, v in attrs) + "}"


def print_op(op) -> str:
    """One op (a k3c.ir.core.Op) as one line."""
    parts = []
    if op.results:
        parts.append(", ".join("%" + r for r in op.results) + " = ")
    parts.append(f"{op.op}({', '.join('%' + i for i in op.inputs)})")
    if op.attrs:
        parts.append(" " + format_attrs(op.attrs))
    if op.types:
        parts.append(" : " + ", ".join(map(str, op.types)))
    if op.loc:
        parts.append(f" loc({quote(op.loc)})")
    return "".join(parts)


def print_module(module, *, header: Iterable[str] = ()) -> str:
    """The module (a k3c.ir.core.Module) as text; `header` lines are written first as `# ` comments (the parser
    skips them)."""
    lines = [f"# {line}".rstrip() for h in header for line in (str(h).splitlines() or [""])]
    attrs = f" attributes {format_attrs(module.attrs)}" if module.attrs else ""
    lines.append(f"module @{module.name}{attrs} {{")
    lines.extend("  " + print_op(op) for op in module.ops)
    lines.append("  return " + ", ".join("%" + o for o in module.outputs) if module.outputs else "  return")
    lines.append("}")
    return "\n".join(lines) + "\n"
