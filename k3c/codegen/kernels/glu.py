"""Gated activations out[M, F] = act(g, u), fp32 math, bf16/fp16/fp32 io.

    swiglu: silu(g) * u
    situ:   [b_g tanh(g / b_g) sigmoid(g)] * [b_u tanh(u / b_u)]      (betas baked in)
Inputs: either one [M, 2F] tensor (`merged=True`: gate = [:, :F], up = [:, F:], the merged gate_up_proj layout) or
two [M, F] tensors. tanh is written with exp (common.emit_math_helpers): portable across CUDA and HIP.
"""
from __future__ import annotations

from ..kernel import KernelSource
from ..targets import Target
from ..writer import SourceWriter, ident, name_part
from .common import (ELEM_BYTES, check_dim, check_float, elementwise_plan, emit_math_helpers, glu_act,
                     glu_helpers, glu_lines, interpreted, to_dtype)


def emit_glu(inter: int, act: object = "swiglu", *, target: Target, dtype: str = "bf16", out_dtype: str | None = None,
             merged: bool = False, name: str | None = None, ir_op: str = "glu", loc: str = "",
             interpret: bool | None = None) -> KernelSource:
    """Kernel args: merged: x_ptr[M, 2F], out_ptr[M, F], M; split: g_ptr[M, F], u_ptr[M, F], out_ptr[M, F], M.
    Grid (M, cdiv(F, BLOCK_F)). `act`: 'swiglu' | 'situ' | GluAct | frontend ActivationSpec."""
    F = check_dim(inter, "intermediate size")
    check_float(dtype)
    odt = check_float(out_dtype or dtype, "out_dtype")
    a = glu_act(act)
    plan = elementwise_plan(F, max(ELEM_BYTES[dtype], ELEM_BYTES[odt]), target)
    interp = interpreted(target, interpret)
    default = f"k3c_glu_{name_part(a.tag())}{'_merged' if merged else ''}_fwd_f{F}_{name_part(dtype)}"
    kname = ident(name if name is not None else default)
    sig = {"x_ptr": f"*{dtype}"} if merged else {"g_ptr": f"*{dtype}", "u_ptr": f"*{dtype}"}
    sig.update({"out_ptr": f"*{odt}", "M": "i32"})
    constexprs = {"F": F, "BLOCK_F": plan.block}
    even = F % plan.block == 0
    mk = "" if even else ", mask=mask, other=0.0"
    sk = "" if even else ", mask=mask"

    w = SourceWriter()
    beta = f" beta_gate={a.beta_gate!r} beta_up={a.beta_up!r}" if a.kind == "situ" else ""
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"glu {a.kind}{beta} F={F} merged={merged} in:{dtype} out:{odt} BLOCK_F={plan.block} "
                    f"num_warps={plan.num_warps}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, **glu_helpers(a), rtne_bf16=interp and odt == "bf16")
    with w.jit_function(kname, list(sig), list(constexprs)):
        w.line("row = tl.program_id(0).to(tl.int64)")
        w.line("cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)")
        if not even:
            w.line("mask = cols < F")
        if merged:
            w.line(f"g = tl.load(x_ptr + row * (2 * F) + cols{mk}).to(tl.float32)")
            w.line(f"u = tl.load(x_ptr + row * (2 * F) + F + cols{mk}).to(tl.float32)")
        else:
            w.line(f"g = tl.load(g_ptr + row * F + cols{mk}).to(tl.float32)")
            w.line(f"u = tl.load(u_ptr + row * F + cols{mk}).to(tl.float32)")
        w.lines(glu_lines(a, "g", "u", "y"))
        w.line(f"tl.store(out_ptr + row * F + cols, {to_dtype('y', odt, interp)}{sk})")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs,
                        grid=("M", "cdiv(F, BLOCK_F)"), num_warps=plan.num_warps, num_stages=1, ir_op=ir_op,
                        loc=loc)


__all__ = ["emit_glu"]
