"""GEMM template C[M, N] = A[M, K] @ W[N, K]^T (W as torch.nn.Linear stores it), fp32 accumulation with tl.dot.

N and K (the weight's shape) are baked in; M (tokens) is a runtime arg, and the tile sizes are chosen for a bucket of
M (common.gemm_plan: decode M <= 16 gets 16-row tiles). Programs are ordered in GROUP_M super-rows (L2 reuse of W).
Loads are unmasked along M and N (row indices wrap with % M, % N; only the store is masked) and masked along K only
when K % BLOCK_K != 0. Row offsets are int64 (M x K may exceed 2^31).

Epilogue (chosen at emit time, in this order on the fp32 accumulator): + bias[N], activation, + residual[M, N].
`interpret` (default: the target is the interpreter) emits the interpreter variant (common.interpreted): bf16 tiles
reach tl.dot as fp32 copies and bf16 stores round to nearest even in integer ops; the wrappers set it whenever they
run a kernel through the interpreter, whatever target its tiles were planned for.

`emit_gemm_glu` computes gate and up in one kernel (two accumulators over the same A tile, W_gate and W_up streamed
side by side) and applies the GLU (SwiGLU / SiTU-GLU) in the epilogue: out[M, F] = act(A Wg^T, A Wu^T).
"""
from __future__ import annotations

from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, ident, name_part, num
from .common import (ELEM_BYTES, check_dim, check_float, emit_math_helpers, epi_act, epi_helpers,
                     epi_lines, gemm_plan, glu_act, glu_helpers, glu_lines, interpreted, to_dtype)

FP32_PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16x3", "bf16x6")  # which exist depends on the backend


def _io_dtypes(dtype: str, w_dtype: str | None, out_dtype: str | None, fp32_precision: str) -> tuple[str, str, str]:
    """(A, W, C) dtypes, W and C defaulting to A's; with the fp32 dot precision checked."""
    dt = check_float(dtype)
    wdt, odt = check_float(w_dtype or dt, "w_dtype"), check_float(out_dtype or dt, "out_dtype")
    if fp32_precision not in FP32_PRECISIONS:
        raise CodegenError(f"fp32_precision must be one of {FP32_PRECISIONS}, got {fp32_precision!r}")
    return dt, wdt, odt


def _emit(*, kname: str, N: int, K: int, m_hint: int, target: Target, dtype: str, w_dtype: str, out_dtype: str,
          glu, act, bias: bool, bias_dtype: str, residual: bool, residual_dtype: str, fp32_precision: str,
          ir_op: str, loc: str, plan_override=None, interpret: bool | None = None) -> KernelSource:
    n_b = 2 if glu is not None else 1
    interp = interpreted(target, interpret)
    plan = plan_override or gemm_plan(m_hint, N, K, max(ELEM_BYTES[dtype], ELEM_BYTES[w_dtype]), target, n_b=n_b)
    BM, BN, BK = plan.block_m, plan.block_n, plan.block_k
    k_tiles = -(-K // BK)
    even_k = K % BK == 0
    even_n = N % BN == 0
    dot_kw = f', input_precision="{fp32_precision}"' if dtype == "fp32" else ""
    up = ""
    if interp and dtype == "bf16":
        up, dot_kw = ".to(tl.float32)", ', input_precision="ieee"'

    sig: dict[str, str] = {"a_ptr": f"*{dtype}"}
    if glu is not None:
        sig.update({"wg_ptr": f"*{w_dtype}", "wu_ptr": f"*{w_dtype}"})
    else:
        sig["w_ptr"] = f"*{w_dtype}"
    if bias:
        sig["bias_ptr"] = f"*{bias_dtype}"
    if residual:
        sig["res_ptr"] = f"*{residual_dtype}"
    sig.update({"c_ptr": f"*{out_dtype}", "M": "i32"})
    constexprs = {"N": N, "K": K, "BLOCK_M": BM, "BLOCK_N": BN, "BLOCK_K": BK, "GROUP_M": plan.group_m}

    w = SourceWriter()
    what = (f"gemm_glu {glu.kind}" + (f" beta_gate={glu.beta_gate!r} beta_up={glu.beta_up!r}"
                                      if glu.kind == "situ" else "")) if glu is not None else \
        f"gemm act={act.kind}" + (f" beta={act.beta!r}" if act.kind.startswith("situ") else "") + \
        f" bias={bias} residual={residual}"
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"{what} N={N} K={K} a:{dtype} w:{w_dtype} out:{out_dtype} M-bucket={m_hint}",
                    f"tiles {BM}x{BN}x{BK} group_m={plan.group_m} num_warps={plan.num_warps} "
                    f"num_stages={plan.num_stages} planned smem={plan.smem_bytes} B"
                    + (f" fp32 dot precision={fp32_precision}" if dtype == "fp32" else "")
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, **(glu_helpers(glu) if glu is not None else epi_helpers(act)),
                      rtne_bf16=interp and "bf16" in (out_dtype, dtype))
    w_names = ["wg", "wu"] if glu is not None else ["w"]
    with w.jit_function(kname, list(sig), list(constexprs)):
        w.line("pid = tl.program_id(0)")
        w.line("num_pid_m = tl.cdiv(M, BLOCK_M)")
        w.line(f"num_pid_n = {num(-(-N // BN))}")
        w.line("num_pid_in_group = GROUP_M * num_pid_n")
        w.line("group_id = pid // num_pid_in_group")
        w.line("first_pid_m = group_id * GROUP_M")
        w.line("group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)")
        w.line("pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)")
        w.line("pid_n = (pid % num_pid_in_group) // group_size_m")
        w.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        w.line("offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        w.line("offs_k = tl.arange(0, BLOCK_K)")
        w.line("rows_a = (offs_m % M).to(tl.int64)  # wrap instead of masking the loads; the store is masked")
        w.line("rows_w = (offs_n % N).to(tl.int64)" if not even_n else "rows_w = offs_n.to(tl.int64)")
        w.line("a_ptrs = a_ptr + rows_a[:, None] * K + offs_k[None, :]")
        for wn in w_names:
            w.line(f"{wn}_ptrs = {wn}_ptr + rows_w[None, :] * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N] of W^T")
        for wn in w_names:
            w.line(f"acc_{wn} = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        w.line(f"for kb in range(0, {num(k_tiles)}):")
        with w.indent():
            if even_k:
                w.line("a = tl.load(a_ptrs)")
            else:
                w.line("k_ok = offs_k < K - kb * BLOCK_K")
                w.line("a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)")
            for wn in w_names:
                if even_k:
                    w.line(f"{wn} = tl.load({wn}_ptrs)")
                else:
                    w.line(f"{wn} = tl.load({wn}_ptrs, mask=k_ok[:, None], other=0.0)")
                if w_dtype != dtype:   # as the reference's linear: W cast to A's dtype (rounded), then the product
                    w.line(f"{wn} = " + (to_dtype(f"{wn}.to(tl.float32)", dtype, interp) if dtype != "fp32"
                                         else f"{wn}.to(tl.float32)"))
                w.line(f"acc_{wn} = tl.dot(a{up}, {wn}{up}, acc_{wn}{dot_kw})")
            w.line("a_ptrs += BLOCK_K")
            for wn in w_names:
                w.line(f"{wn}_ptrs += BLOCK_K")
        # epilogue
        w.line("n_ok = offs_n < N")
        w.line("c_mask = (offs_m[:, None] < M) & n_ok[None, :]")
        w.line("c_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]")
        if glu is not None:
            w.lines(glu_lines(glu, "acc_wg", "acc_wu", "acc"))
        else:
            w.line("acc = acc_w")
            if bias:
                w.line("acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]")
            w.lines(epi_lines(act, "acc"))
            if residual:
                w.line("acc += tl.load(res_ptr + c_offs, mask=c_mask, other=0.0).to(tl.float32)")
        w.line(f"tl.store(c_ptr + c_offs, {to_dtype('acc', out_dtype, interp)}, mask=c_mask)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=constexprs,
                        grid=("cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)",), num_warps=plan.num_warps,
                        num_stages=plan.num_stages, ir_op=ir_op, loc=loc)


def emit_gemm(n: int, k: int, *, target: Target, m_hint: int = 128, dtype: str = "bf16", w_dtype: str | None = None,
              out_dtype: str | None = None, bias: bool = False, bias_dtype: str | None = None, act: object = None,
              residual: bool = False, residual_dtype: str | None = None, fp32_precision: str = "ieee",
              name: str | None = None, ir_op: str = "linear", loc: str = "", plan=None,
              interpret: bool | None = None) -> KernelSource:
    """C[M, N] = act(A[M, K] W[N, K]^T + bias) + residual.

    Kernel args: a_ptr, w_ptr, (bias_ptr[N]), (res_ptr[M, N]), c_ptr, M; grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),).
    m_hint: the token count the tiles are chosen for (any M runs correctly). act: None | 'silu' | 'sigmoid' |
    'relu' | ('situ_gate', beta) | ('situ_up', beta). W of another dtype is cast to A's dtype per tile (as the
    reference's linear does). fp32_precision applies to fp32 A only ('ieee' = exact fp32 products)."""
    N, K = check_dim(n, "N"), check_dim(k, "K")
    dt, wdt, odt = _io_dtypes(dtype, w_dtype, out_dtype, fp32_precision)
    a = epi_act(act)
    tags = ["k3c_gemm", f"n{N}", f"k{K}", name_part(dt), f"m{int(m_hint)}"]
    tags += (["bias"] if bias else []) + ([name_part(a.tag())] if a.kind != "none" else []) + \
        (["res"] if residual else [])
    kname = ident(name if name is not None else "_".join(tags))
    return _emit(kname=kname, N=N, K=K, m_hint=int(m_hint), target=target, dtype=dt, w_dtype=wdt, out_dtype=odt,
                 glu=None, act=a, bias=bias, bias_dtype=check_float(bias_dtype or dt, "bias_dtype"),
                 residual=residual, residual_dtype=check_float(residual_dtype or odt, "residual_dtype"),
                 fp32_precision=fp32_precision, ir_op=ir_op, loc=loc, plan_override=plan, interpret=interpret)


def emit_gemm_glu(inter: int, k: int, act: object = "swiglu", *, target: Target, m_hint: int = 128,
                  dtype: str = "bf16", w_dtype: str | None = None, out_dtype: str | None = None,
                  fp32_precision: str = "ieee", name: str | None = None, ir_op: str = "linear_glu", loc: str = "",
                  plan=None, interpret: bool | None = None) -> KernelSource:
    """out[M, F] = act(A[M, K] Wg[F, K]^T, A Wu[F, K]^T) with act SwiGLU or SiTU-GLU (fp32 epilogue).

    Kernel args: a_ptr, wg_ptr, wu_ptr, c_ptr, M; grid (cdiv(M, BLOCK_M) * cdiv(F, BLOCK_N),). A merged
    gate_up weight [2F, K] is passed as its two row halves (each contiguous)."""
    F, K = check_dim(inter, "intermediate size"), check_dim(k, "K")
    dt, wdt, odt = _io_dtypes(dtype, w_dtype, out_dtype, fp32_precision)
    g = glu_act(act)
    default = "_".join(["k3c_gemm_glu", name_part(g.tag()), f"f{F}", f"k{K}", name_part(dt), f"m{int(m_hint)}"])
    kname = ident(name if name is not None else default)
    return _emit(kname=kname, N=F, K=K, m_hint=int(m_hint), target=target, dtype=dt, w_dtype=wdt, out_dtype=odt,
                 glu=g, act=None, bias=False, bias_dtype=dt, residual=False, residual_dtype=odt,
                 fp32_precision=fp32_precision, ir_op=ir_op, loc=loc, plan_override=plan, interpret=interpret)


__all__ = ["emit_gemm", "emit_gemm_glu", "FP32_PRECISIONS"]
