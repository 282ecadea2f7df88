"""fuse-residual-norm: `s = add(x, r); n = rmsnorm(s, w)` -> `s, n = rmsnorm_residual(x, r, w)`.

The pre-norm residual stream adds each sublayer output and immediately normalises the sum for the next sublayer;
one kernel reads both inputs once, writes the new residual and the normed activation. Counts: `fused`.
"""
from __future__ import annotations

from ..ir.builder import Builder
from ..ir.core import Module, Op
from .registry import PassContext, register_pass


@register_pass("fuse-residual-norm")
def fuse_residual_norm(module: Module, ctx: PassContext) -> Module:
    defs = {r: op for op in module.ops for r in op.results}
    # the add each fusable rmsnorm consumes; an add feeds at most one fused norm
    fused_add: dict[str, Op] = {}
    for op in ctx.walk(module.ops):
        if op.op != "rmsnorm":
            continue
        src = defs.get(op.inputs[0])
        if src is None or src.op != "add" or src.results[0] in fused_add:
            continue
        fused_add[src.results[0]] = op
    if not fused_add:
        return module
    b = Builder.like(module)
    norm_of = {id(norm): add for add, norm in fused_add.items()}
    for op in module.ops:
        if op.op == "add" and op.results[0] in fused_add:
            continue                       # emitted together with its norm
        if id(op) in norm_of:
            add = defs[norm_of[id(op)]]
            attrs = {"eps": op.attr("eps")}
            if op.attr("layer", None) is not None:
                attrs["layer"] = op.attr("layer")
            b.append(b.make("rmsnorm_residual", (*add.inputs, op.inputs[1]), attrs, op.loc,
                            results=(add.results[0], op.results[0])))
            ctx.count("fused")
            continue
        b.append(op)
    return b.build(module.outputs)
