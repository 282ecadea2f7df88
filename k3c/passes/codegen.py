"""codegen: decide, for every compute op, how the runtime executes it (attr `impl`).

- "kernel": a Triton emitter is registered for the op (k3c/codegen/catalogue/); `k3c compile` emits and compiles
  its kernels ahead of time and the runtime launches them.
- "extern": dense work handed to torch / the vendor BLAS on purpose (lm_head GEMM with float weights; an MXFP4
  lm_head (the mxfp4 pass) is "kernel": the dense MXFP4 GEMM, elementwise adds left unfused,
  weight transforms evaluated once at load); the manifest lists them.
- "extern:reference": ops that no lowering pass turned into kernels (a pipeline without it) run the eager
  reference, marked so nothing hides.
Counts: `kernel`, `extern`, `extern:reference`, and `<impl>.<op>`.
"""
from __future__ import annotations

from ..ir.builder import Builder
from ..ir.core import Module
from ..ir.ops import get_op_def
from .registry import PassContext, register_pass

# Ops executed by torch on purpose (not a stand-in for a missing kernel).
# collectives run through torch.distributed (NCCL / gloo), the engine that owns the transport
EXTERN_OPS = frozenset({"lm_head", "add", "all_reduce", "all_gather", "reduce_scatter", "seq_scatter", "seq_gather"})
NO_IMPL_OPS = frozenset({"input", "param"})


def impl_for(op) -> str | None:
    from ..codegen.catalogue import EMITTERS

    if op.op in NO_IMPL_OPS:
        return None
    if op.op in EXTERN_OPS and op.attr("weight_format", "bf16") != "mxfp4":
        return "extern"
    if op.op in EMITTERS:
        return "kernel"
    opdef = get_op_def(op.op)
    if op.op in EXTERN_OPS or (opdef is not None and opdef.weight_transform):
        return "extern"
    return "extern:reference"


@register_pass("codegen")
def codegen(module: Module, ctx: PassContext) -> Module:
    b = Builder.like(module)
    for op in ctx.walk(module.ops):
        impl = impl_for(op)
        if impl is None or op.attr("impl", None) == impl:
            b.append(op)
            continue
        b.append(op.with_attrs(impl=impl))
        ctx.count(impl)
        ctx.count(f"{impl}.{op.op}")
    return b.build(module.outputs)
