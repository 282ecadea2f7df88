"""Row softmax over the last dim: y = softmax(scale * x), fp32 math, output in the output dtype.

One row per program. A row that fits one block (common.row_plan) is loaded once; a longer row takes two passes:
pass 1 keeps a per-lane running max m and sum l (online softmax: l <- l e^(m - m') + e^(x - m')), reduces them
across lanes at the end; pass 2 writes e^(x - m) / l. Masked lanes hold -inf and never produce NaN (a row that is
all -inf gives NaN, as torch.softmax does).
"""
from __future__ import annotations

from ..kernel import KernelSource
from ..targets import Target
from ..writer import SourceWriter, fnum, ident, name_part
from .common import ELEM_BYTES, check_dim, check_float, emit_math_helpers, interpreted, row_plan, to_dtype


def emit_softmax(n_cols: int, *, target: Target, scale: float = 1.0, dtype: str = "bf16",
                 out_dtype: str | None = None, max_block: int | None = None, name: str | None = None,
                 ir_op: str = "softmax", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Kernel args: x_ptr[M, D], out_ptr[M, D], M; grid (M,). `scale` is baked in (1.0 emits no multiply)."""
    D = check_dim(n_cols, "n_cols")
    check_float(dtype)
    odt = check_float(out_dtype or dtype, "out_dtype")
    s_lit = fnum(scale)
    plan = row_plan(D, max(ELEM_BYTES[dtype], ELEM_BYTES[odt]), target, max_block)
    interp = interpreted(target, interpret)
    kname = ident(name if name is not None else f"k3c_softmax_fwd_d{D}_{name_part(dtype)}")
    sig = {"x_ptr": f"*{dtype}", "out_ptr": f"*{odt}", "M": "i32"}
    constexprs = {"D": D, "BLOCK_D": plan.block}
    scaled = "x * " + s_lit if float(scale) != 1.0 else "x"

    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"softmax D={D} scale={s_lit} in:{dtype} out:{odt} BLOCK_D={plan.block} looped={plan.looped} "
                    f"num_warps={plan.num_warps}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and odt == "bf16")

    def load(cols_expr: str) -> None:
        w.line(f"cols = {cols_expr}")
        w.line("mask = cols < D")
        w.line("x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)")
        w.line(f"x = tl.where(mask, {scaled}, float('-inf'))")

    with w.jit_function(kname, list(sig), list(constexprs)):
        w.line("row = tl.program_id(0).to(tl.int64)")
        w.line("base = row * D")
        if not plan.looped:
            load("tl.arange(0, BLOCK_D)")
            w.line("m = tl.max(x, axis=0)")
            w.line("e = tl.exp(x - m)")
            w.line("y = e / tl.sum(e, axis=0)")
            w.line(f"tl.store(out_ptr + base + cols, {to_dtype('y', odt, interp)}, mask=mask)")
        else:
            w.line("m_i = tl.full([BLOCK_D], float('-inf'), tl.float32)")
            w.line("l_i = tl.zeros([BLOCK_D], dtype=tl.float32)")
            w.line("for off in range(0, D, BLOCK_D):")
            with w.indent():
                load("off + tl.arange(0, BLOCK_D)")
                w.line("m_new = tl.maximum(m_i, x)")
                w.line("# a lane that has seen only -inf subtracts 0 instead: alpha = p = 0, never inf - inf")
                w.line("m_sub = tl.where(m_new == float('-inf'), 0.0, m_new)")
                w.line("l_i = l_i * tl.exp(m_i - m_sub) + tl.exp(x - m_sub)")
                w.line("m_i = m_new")
            w.line("m = tl.max(m_i, axis=0)")
            w.line("m = tl.where(m == float('-inf'), 0.0, m)")
            w.line("l = tl.sum(l_i * tl.exp(m_i - m), axis=0)")
            w.line("for off in range(0, D, BLOCK_D):")
            with w.indent():
                load("off + tl.arange(0, BLOCK_D)")
                w.line("y = tl.exp(x - m) / l")
                w.line(f"tl.store(out_ptr + base + cols, {to_dtype('y', odt, interp)}, mask=mask)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs, grid=("M",),
                        num_warps=plan.num_warps, num_stages=1, ir_op=ir_op, loc=loc)


__all__ = ["emit_softmax"]
