"""Common-subexpression elimination: of two pure ops with equal op, inputs, attrs and types, keep the first.

This merges duplicate `param` ops of one weight name too (the attrs hold the name). The survivor keeps its own
loc; uses of the duplicate's results are renamed to the survivor's, module outputs included.
Counts: `hits`, and `hits.<op>` per op kind.
"""
from __future__ import annotations

from ..ir.core import Module, Op
from .registry import PassContext, cse_key, register_pass


@register_pass("cse", ensures=("unique-params", "no-common-subexpressions"))
def cse(module: Module, ctx: PassContext) -> Module:
    """Merge identical pure ops."""
    rename: dict[str, str] = {}
    seen: dict[tuple, Op] = {}
    out: list[Op] = []
    ctx.count("hits", 0)
    for op in ctx.walk(module.ops):
        if rename and any(v in rename for v in op.inputs):
            op = op.replace(inputs=tuple(rename.get(v, v) for v in op.inputs))
        key = cse_key(op)
        if key is not None:
            first = seen.get(key)
            if first is not None:
                rename.update(zip(op.results, first.results))
                ctx.count("hits")
                ctx.count(f"hits.{op.op}")
                continue
            seen[key] = op
        out.append(op)
    if not rename:
        return module
    return module.replace(ops=tuple(out), outputs=tuple(rename.get(o, o) for o in module.outputs))
