"""Embedding gather: out[i, :] = table[ids[i], :] (ids int64), vectorised over the hidden dim.

Grid (N, cdiv(D, BLOCK_D)): tokens on the first grid axis (2^31 on every backend), column blocks on the second.
An id outside [0, V) reads nothing and writes a zero row (no out-of-bounds access on the device).
"""
from __future__ import annotations

from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, ident, name_part
from .common import ELEM_BYTES, check_dim, check_float, elementwise_plan


def emit_embedding(vocab: int, hidden: int, *, target: Target, dtype: str = "bf16", ids_dtype: str = "i64",
                   name: str | None = None, ir_op: str = "embedding", loc: str = "") -> KernelSource:
    """Kernel args: ids_ptr[N] (int64), table_ptr[V, D], out_ptr[N, D], N; grid (N, cdiv(D, BLOCK_D))."""
    V = check_dim(vocab, "vocab")
    D = check_dim(hidden, "hidden")
    check_float(dtype)
    if ids_dtype not in ("i64", "i32"):
        raise CodegenError(f"ids_dtype must be i64 or i32, got {ids_dtype!r}")
    plan = elementwise_plan(D, ELEM_BYTES[dtype], target)
    kname = ident(name if name is not None else f"k3c_embedding_fwd_v{V}_d{D}_{name_part(dtype)}")
    sig = {"ids_ptr": f"*{ids_dtype}", "table_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "N": "i32"}
    constexprs = {"V": V, "D": D, "BLOCK_D": plan.block}
    even = D % plan.block == 0

    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"embedding V={V} D={D} {dtype} BLOCK_D={plan.block} num_warps={plan.num_warps}"])
    w.imports()
    with w.jit_function(kname, list(sig), list(constexprs)):
        w.line("tok = tl.program_id(0).to(tl.int64)")
        w.line("cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)")
        w.line("idx = tl.load(ids_ptr + tok).to(tl.int64)")
        w.line("valid = (idx >= 0) & (idx < V)")
        w.line("safe = tl.where(valid, idx, 0)")
        w.line("lim = tl.where(valid, D, 0)  # a bad id loads nothing (a scalar bound, not a scalar-bool mask)")
        w.line("row = tl.load(table_ptr + safe * D + cols, mask=cols < lim, other=0.0)")
        w.line("tl.store(out_ptr + tok * D + cols, row" + (", mask=cols < D)" if not even else ")"))
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs,
                        grid=("N", "cdiv(D, BLOCK_D)"), num_warps=plan.num_warps, num_stages=1, ir_op=ir_op,
                        loc=loc)


__all__ = ["emit_embedding"]
