"""RMSNorm over the last dim, optionally fused with the residual add before it.

    plain:    out = x / sqrt(mean(x^2) + eps) * w
    residual: s = x + r (rounded to the residual dtype, written to res_out); out = rmsnorm(s) * w
One row per program, fp32 accumulation, eps and the hidden size baked in. Rows longer than the target's row block
(k3c.codegen.kernels.common.row_plan) are processed in two passes over BLOCK_D-wide slices.
"""
from __future__ import annotations

from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part
from .common import ELEM_BYTES, check_dim, check_float, emit_math_helpers, interpreted, row_plan, to_dtype


def emit_rmsnorm(hidden: int, eps: float, *, target: Target, dtype: str = "bf16", weight_dtype: str | None = None,
                 residual: bool = False, residual_dtype: str | None = None, out_dtype: str | None = None,
                 has_weight: bool = True, max_block: int | None = None, name: str | None = None,
                 ir_op: str = "rms_norm", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Kernel args: x_ptr[M, D], (r_ptr[M, D]), (w_ptr[D]), out_ptr[M, D], (res_out_ptr[M, D]), M; grid (M,).

    dtype: x's dtype; residual_dtype: r's and res_out's (default dtype); out_dtype: out's (default residual_dtype
    when fused, else dtype); max_block caps BLOCK_D (tests use it to force the looped path)."""
    D = check_dim(hidden, "hidden")
    check_float(dtype)
    wdt = check_float(weight_dtype or dtype, "weight_dtype")
    rdt = check_float(residual_dtype or dtype, "residual_dtype")
    odt = check_float(out_dtype or (rdt if residual else dtype), "out_dtype")
    eps_lit = fnum(eps)
    if float(eps) < 0:
        raise CodegenError(f"eps must be >= 0, got {eps!r}")
    plan = row_plan(D, max(ELEM_BYTES[dtype], ELEM_BYTES[odt]), target, max_block)
    interp = interpreted(target, interpret)
    default = "_".join(["k3c_rmsnorm", *(["residual"] if residual else []), "fwd", f"d{D}", name_part(dtype)])
    kname = ident(name if name is not None else default)

    sig: dict[str, str] = {"x_ptr": f"*{dtype}"}
    if residual:
        sig["r_ptr"] = f"*{rdt}"
    if has_weight:
        sig["w_ptr"] = f"*{wdt}"
    sig["out_ptr"] = f"*{odt}"
    if residual:
        sig["res_out_ptr"] = f"*{rdt}"
    sig["M"] = "i32"
    constexprs = {"D": D, "BLOCK_D": plan.block}

    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"rmsnorm D={D} eps={eps_lit} residual={residual} weight={has_weight} x:{dtype} "
                    f"out:{odt} BLOCK_D={plan.block} looped={plan.looped} num_warps={plan.num_warps}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and "bf16" in (odt, rdt if residual else odt))
    even = D % plan.block == 0
    mask_kw = "" if even else ", mask=mask, other=0.0"
    smask = "" if even else ", mask=mask"

    def load_sum(cols_line: str) -> None:
        """x (+ r -> res_out) as fp32 `x`, with `cols` and `mask` defined."""
        w.line(cols_line)
        if not even:
            w.line("mask = cols < D")
        w.line(f"x = tl.load(x_ptr + base + cols{mask_kw}).to(tl.float32)")
        if residual:
            w.line(f"r = tl.load(r_ptr + base + cols{mask_kw}).to(tl.float32)")
            w.line(f"s = {to_dtype('x + r', rdt, interp)}")
            w.line(f"tl.store(res_out_ptr + base + cols, s{smask})")
            w.line("x = s.to(tl.float32)")

    def scale_store() -> None:
        if has_weight:
            w.line(f"wt = tl.load(w_ptr + cols{mask_kw}).to(tl.float32)")
            w.line("y = (x * rstd) * wt")
        else:
            w.line("y = x * rstd")
        w.line(f"tl.store(out_ptr + base + cols, {to_dtype('y', odt, interp)}{smask})")

    with w.jit_function(kname, list(sig), list(constexprs)):
        w.line("row = tl.program_id(0).to(tl.int64)")
        w.line("base = row * D")
        if not plan.looped:
            load_sum("cols = tl.arange(0, BLOCK_D)")
            w.line(f"rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + {eps_lit})")
            scale_store()
        else:
            w.line("acc = tl.zeros([BLOCK_D], dtype=tl.float32)")
            w.line("for off in range(0, D, BLOCK_D):")
            with w.indent():
                load_sum("cols = off + tl.arange(0, BLOCK_D)")
                w.line("acc += x * x")
            w.line(f"rstd = tl.rsqrt(tl.sum(acc, axis=0) / D + {eps_lit})")
            if residual:
                w.line("tl.debug_barrier()  # pass 2 re-reads the res_out row written by pass 1")
            w.line("for off in range(0, D, BLOCK_D):")
            with w.indent():
                w.line("cols = off + tl.arange(0, BLOCK_D)")
                if not even:
                    w.line("mask = cols < D")
                src = "res_out_ptr" if residual else "x_ptr"
                w.line(f"x = tl.load({src} + base + cols{mask_kw}).to(tl.float32)")
                scale_store()
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs, grid=("M",),
                        num_warps=plan.num_warps, num_stages=1, ir_op=ir_op, loc=loc)


__all__ = ["emit_rmsnorm"]
