"""Kimi Delta Attention kernels (K3.md section 2): input prep, chunked prefill, fused recurrent decode, output.

    emit_kda_prep    causal short conv (conv tails in / out) + SiLU for q, k, v; L2 norm of q, k; gate activation
                     (softplus or safe); beta = sigmoid(b). Writes one packed fp32 row per token:
                     [q (H*D) | k (H*D) | v (H*D) | g (H*D) | beta (H)].
    emit_kda_chunk   the chunked UT/WY form, one program per (sequence, head, V block), sequential over chunks of BT
                     tokens, fp32 state in registers, initial state in / final state out, variable lengths (cu_seqlens).
    emit_kda_decode  one token per sequence, everything fused: conv (tails updated), SiLU, L2 norm, gate, beta, the
                     delta-rule step on the fp32 state (in place allowed), per-head RMSNorm x sigmoid(output gate).
    emit_kda_out     per-head RMSNorm x sigmoid(output gate) for prefill.

Numerics of the chunk kernel (the reference's kda_chunked is exact through pairwise differences + a triangular
solve; a kernel cannot form [BT, BT, K] pairwise tensors cheaply):
  * Intra-chunk decays e^(Gamma_i - Gamma_j) are split at an anchor row m in the middle of the chunk:
    (k_i e^(Gamma_i - Gamma_m)) . (k_j e^(Gamma_m - Gamma_j)). Each factor spans at most half the chunk, so with the
    safe gate (g >= lb = -5) and BT = 16 the exponents stay within |40| (fp32 exp overflows past 88): exact for the
    safe gate, and the factors are clamped to [-80, 80] so nothing is ever inf/NaN for any gate.
  * Every inter-chunk factor (q e^Gamma, k e^(Gamma_C - Gamma), e^Gamma_C) has a non-positive exponent.
  * (I + A_kk)^-1 with A_kk strictly lower triangular (nilpotent) is the exact finite product
    (I - A)(I + A^2)(I + A^4)...(I + A^(BT/2)): log2(BT) small matmuls instead of a sequential substitution.
Matmul precision: `ieee` (fp32 FMA, exact in tests) for fp32 models; `bf16` operands with fp32 accumulation (tensor
cores, what fla does) or `tf32` for bf16 models on GPUs. The interpreter always multiplies in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part
from .common import check_dim, check_float, emit_math_helpers, interpreted, to_dtype

GATES = ("softplus", "safe")
DOT_MODES = ("ieee", "tf32", "bf16")
EXP_CLAMP = 80.0          # |exponent| cap of the anchored intra-chunk factors (e^88 overflows fp32)


def _check_pow2(value: int, what: str) -> int:
    check_dim(value, what)
    if value & (value - 1):
        raise CodegenError(f"{what} must be a power of two, got {value}")
    return value


@dataclass(frozen=True)
class KDAPlan:
    """Block sizes of the KDA kernels for one target and head dim."""
    chunk: int            # BT: tokens per chunk step of the chunk kernel (sub-chunk of target.kda_chunk)
    block_v: int          # BV: V columns per chunk-kernel program
    chunk_warps: int
    prep_block_t: int     # tokens per prep program
    decode_warps: int     # warps of the fused decode program holding a whole [D, D] state
    dot: str              # matmul precision of the chunk kernel's big products
    decode_block_v: int = 32   # V columns per decode program when the output norm is not fused (kda_out follows)


def kda_plan(head_dim: int, dtype: str, target: Target, *, chunk: int | None = None, block_v: int | None = None,
             dot: str | None = None, chunk_warps: int | None = None) -> KDAPlan:
    """The chunk kernel steps through a sequence in chunks of BT = min(target.kda_chunk, 16) tokens (16 keeps the
    anchored decays exact at lb = -5 and is the smallest matmul tile); each program holds a [D, BV] fp32 state slice
    in registers: BV = 64, so a D=128 head spreads over 2 programs: the fastest spill-free variant measured on the
    H200 (BV=32 repeats the intra-chunk work 4x; BV=128 spills on sm_90); no spills at 8 warps on sm_90 and gfx950.
    Overrides are for benchmarks and tests."""
    D = _check_pow2(head_dim, "head_dim")
    if D < 16:
        raise CodegenError(f"head_dim must be >= 16 for the KDA kernels, got {D}")
    bt = chunk if chunk is not None else min(int(target.kda_chunk), 16)
    _check_pow2(bt, "chunk")
    if not 16 <= bt <= 32:
        raise CodegenError(f"KDA chunk step must be 16 or 32 tokens, got {bt}")
    lanes = max(int(target.warp_size), 32)
    bv = block_v if block_v is not None else min(D, 64)
    _check_pow2(bv, "block_v")
    if bv < 16 or bv > D:
        raise CodegenError(f"block_v must be in [16, head_dim], got {bv}")
    if dot is None:
        dot = "ieee" if dtype == "fp32" else "bf16"
    if dot not in DOT_MODES:
        raise CodegenError(f"dot precision must be one of {DOT_MODES}, got {dot!r}")
    # D = 128 needs 8 warps to stay clear of spills on sm_90 and gfx950 (4 warps spill 9-56 registers; measured with
    # aot.compile_kernels); the interpreter runs a program as numpy ops (warps are irrelevant: 1)
    warps = chunk_warps if chunk_warps is not None else (8 if D >= 128 else 4)
    if target.backend == "cpu":
        warps = 1 if chunk_warps is None else warps
    # decode: the whole [D, D] fp32 state of one head in one program: 32 fp32 values per lane
    dwarps = max(1, min(16, D * D // (32 * lanes)))
    return KDAPlan(bt, bv, warps, 64 if target.backend == "cpu" else 16, dwarps, dot, min(D, 32))


def _dot(a: str, b: str, mode: str, interp: bool) -> str:
    if interp or mode == "ieee":
        return f'tl.dot({a}, {b}, input_precision="ieee")'
    if mode == "tf32":
        return f'tl.dot({a}, {b}, input_precision="tf32")'
    return f"tl.dot(({a}).to(tl.bfloat16), ({b}).to(tl.bfloat16))"


def _gate_lines(gate: str, lb: float, x: str, a: str, out: str) -> list[str]:
    """fp32 gate from x = f + dt_bias and a = exp(A_log[h])."""
    if gate == "softplus":
        # softplus linear above 20 (as torch / fla); log(1 + e^x) otherwise
        return [f"{out} = -{a} * tl.where({x} > 20.0, {x}, tl.log(1.0 + tl.exp(tl.minimum({x}, 20.0))))"]
    if gate == "safe":
        return [f"{out} = {fnum(lb)} * _k3c_sigmoid({a} * {x})"]
    raise CodegenError(f"gate must be one of {GATES}, got {gate!r}")


def _check_gate(gate: str, lb: float) -> None:
    if gate not in GATES:
        raise CodegenError(f"gate must be one of {GATES}, got {gate!r}")
    if gate == "safe" and not (math.isfinite(lb) and lb < 0):
        raise CodegenError(f"the safe gate needs a finite gate_lower_bound < 0, got {lb!r}")


def _round_like(expr: str, dtype: str, interp: bool) -> str:
    """fp32 value rounded through `dtype` (mirrors the reference computing conv / SiLU in the compute dtype)."""
    if dtype == "fp32":
        return expr
    return f"{to_dtype(expr, dtype, interp)}.to(tl.float32)"


# ---- prep -----------------------------------------------------------------------------------------------------
def emit_kda_prep(num_heads: int, head_dim: int, conv_kernel: int, *, gate: str, gate_lower_bound: float,
                  l2norm_eps: float, target: Target, dtype: str = "bf16", block_t: int | None = None,
                  ir_op: str = "kda_prep", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Args: xq, xk, xv, xf [total, H*D], xb [total, H] (projections, `dtype`), wq, wk, wv [H*D, KW] (conv weights),
    a_log [H], dt_bias [H*D], tq_in, tk_in, tv_in [N, H*D, KW-1] (conv tails, `dtype`), tq_out, tk_out, tv_out,
    out [total, 4*H*D + H] fp32, cu [N + 1] i32 (sequence starts), N, T_MAX. Grid (cdiv(T_MAX, BT), N * H)."""
    H, D, KW = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim"), check_dim(conv_kernel, "conv")
    if KW < 2:
        raise CodegenError(f"conv_kernel must be >= 2, got {KW}")
    check_float(dtype)
    _check_gate(gate, gate_lower_bound)
    interp = interpreted(target, interpret)
    BT = _check_pow2(block_t or kda_plan(D, dtype, target).prep_block_t, "block_t")
    HD = H * D
    kname = ident(f"k3c_kda_prep_fwd_h{H}_d{D}_k{KW}_{gate}_{name_part(dtype)}")
    sig = {n: f"*{dtype}" for n in ("xq", "xk", "xv", "xf", "xb")}
    sig.update({n: f"*{dtype}" for n in ("wq", "wk", "wv")})
    sig.update({"a_log": "*fp32", "dt_bias": "*fp32"})
    sig.update({n: f"*{dtype}" for n in ("tq_in", "tk_in", "tv_in", "tq_out", "tk_out", "tv_out")})
    sig.update({"out": "*fp32", "cu": "*i32", "N": "i32", "T_MAX": "i32"})
    const = {"H": H, "D": D, "KW": KW, "BT": BT}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda prep H={H} D={D} conv={KW} gate={gate} lb={fnum(gate_lower_bound)} x:{dtype} BT={BT}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, sigmoid=True, rtne_bf16=interp and dtype == "bf16")
    R = 4 * HD + H
    with w.jit_function(kname, list(sig), list(const)):
        w.lines([
            "tb = tl.program_id(0)",
            "nh = tl.program_id(1)",
            "n = nh // H",
            "h = nh % H",
            "bos = tl.load(cu + n).to(tl.int64)",
            "L = tl.load(cu + n + 1).to(tl.int64) - bos",
            "rt = tb * BT + tl.arange(0, BT).to(tl.int64)",
            "tm = rt < L",
            "rd = tl.arange(0, D)",
            "col = h * D + rd",
            f"tail_base = (n.to(tl.int64) * {HD} + col) * (KW - 1)",
        ])
        for x, wt, tin, tout, slot in (("xq", "wq", "tq_in", "tq_out", 0), ("xk", "wk", "tk_in", "tk_out", 1),
                                       ("xv", "wv", "tv_in", "tv_out", 2)):
            w.line("acc = tl.zeros([BT, D], dtype=tl.float32)")
            w.line("for j in tl.static_range(KW):")
            with w.indent():
                w.lines([
                    "p = rt - (KW - 1) + j",
                    "inseq = tm[:, None] & (p[:, None] >= 0)",
                    "intail = tm[:, None] & (p[:, None] < 0)",
                    f"xs = tl.load({x} + (bos + p)[:, None] * {HD} + col[None, :], mask=inseq, other=0.0)",
                    f"ts = tl.load({tin} + tail_base[None, :] + (KW - 1 + p)[:, None], mask=intail, other=0.0)",
                    f"cw = tl.load({wt} + col * KW + j).to(tl.float32)",
                    "acc += (xs.to(tl.float32) + ts.to(tl.float32)) * cw[None, :]",
                ])
            w.line(f"acc = {_round_like('acc', dtype, interp)}")
            w.line(f"y = {_round_like('acc * _k3c_sigmoid(acc)', dtype, interp)}")
            if slot < 2:
                w.line(f"y = y / tl.sqrt(tl.sum(y * y, axis=1) + {fnum(l2norm_eps)})[:, None]")
            w.line(f"tl.store(out + (bos + rt)[:, None] * {R} + {slot * HD} + col[None, :], y, mask=tm[:, None])")
            # the new tail: the last KW-1 pre-conv inputs (older tail entries when the segment is short)
            w.line("if tb == 0:")
            with w.indent():
                for j in range(KW - 1):
                    w.lines([
                        f"p{j} = rd.to(tl.int64) * 0 + (L - (KW - 1) + {j})",
                        f"n{j} = tl.load({x} + (bos + p{j}) * {HD} + col, mask=p{j} >= 0, other=0.0)"
                        f" + tl.load({tin} + tail_base + (KW - 1 + p{j}), mask=p{j} < 0, other=0.0)",
                    ])
                for j in range(KW - 1):
                    w.line(f"tl.store({tout} + tail_base + {j}, n{j})")
        w.lines([
            "f = tl.load(xf + (bos + rt)[:, None] * " + str(HD) + " + col[None, :], mask=tm[:, None], other=0.0)",
            "f = f.to(tl.float32) + tl.load(dt_bias + col)[None, :]",
            "a = tl.exp(tl.load(a_log + h))",
        ])
        w.lines(_gate_lines(gate, gate_lower_bound, "f", "a", "g"))
        w.lines([
            f"tl.store(out + (bos + rt)[:, None] * {R} + {3 * HD} + col[None, :], g, mask=tm[:, None])",
            "bb = tl.load(xb + (bos + rt) * H + h, mask=tm, other=0.0).to(tl.float32)",
            f"tl.store(out + (bos + rt) * {R} + {4 * HD} + h, _k3c_sigmoid(bb), mask=tm)",
        ])
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const,
                        grid=("cdiv(T_MAX, BT)", "N * H"), num_warps=max(4, min(8, BT * D // 256)), num_stages=1,
                        ir_op=ir_op, loc=loc)


# ---- chunk ----------------------------------------------------------------------------------------------------
def emit_kda_chunk(num_heads: int, head_dim: int, *, target: Target, qk_dtype: str = "fp32", v_dtype: str = "fp32",
                   g_dtype: str = "fp32", beta_dtype: str = "fp32", o_dtype: str = "fp32", scale: float | None = None,
                   plan: KDAPlan | None = None, has_initial_state: bool = True, ir_op: str = "kda_chunk",
                   loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Args: q, k [*, H, D] rows at token stride sq / sk (head stride D), v (sv), g (sg), beta (sb; head stride 1),
    o [total, H, D] (o_dtype), s0 [N, H, D, D] fp32 (read when has_initial_state), sT [N, H, D, D] fp32 (written),
    cu [N + 1] i32, N. Grid (D // BV, N * H). Strides are in elements; s0 may alias sT (each program reads its
    slice before writing it)."""
    H, D = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim")
    for d in (qk_dtype, v_dtype, g_dtype, beta_dtype, o_dtype):
        check_float(d)
    p = plan or kda_plan(D, qk_dtype, target)
    interp = interpreted(target, interpret)
    scale = D ** -0.5 if scale is None else float(scale)
    BT, BV = p.chunk, p.block_v
    LOG = BT.bit_length() - 1
    kname = ident(f"k3c_kda_chunk_fwd_h{H}_d{D}_bt{BT}_bv{BV}_w{p.chunk_warps}_{p.dot}_{name_part(qk_dtype)}"
                  + ("" if has_initial_state else "_nos0"))
    sig = {"q": f"*{qk_dtype}", "k": f"*{qk_dtype}", "v": f"*{v_dtype}", "g": f"*{g_dtype}",
           "beta": f"*{beta_dtype}", "o": f"*{o_dtype}", "s0": "*fp32", "sT": "*fp32", "cu": "*i32",
           "sq": "i32", "sk": "i32", "sv": "i32", "sg": "i32", "sb": "i32", "N": "i32"}
    const = {"H": H, "D": D, "BT": BT, "BV": BV}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda chunk H={H} D={D} BT={BT} BV={BV} dot={p.dot} warps={p.chunk_warps} q/k:{qk_dtype} "
                    f"v:{v_dtype} g:{g_dtype} o:{o_dtype} scale={fnum(scale)}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and o_dtype == "bf16")

    def dot(a, b, mode=p.dot):
        return _dot(a, b, mode, interp)

    with w.jit_function(kname, list(sig), list(const)):
        w.lines([
            "pv = tl.program_id(0)",
            "nh = tl.program_id(1)",
            "n = nh // H",
            "h = nh % H",
            "bos = tl.load(cu + n).to(tl.int64)",
            "L = tl.load(cu + n + 1).to(tl.int64) - bos",
            "rt = tl.arange(0, BT)",
            "rk = tl.arange(0, D)",
            "rv = pv * BV + tl.arange(0, BV)",
            "strict = rt[:, None] > rt[None, :]",
            "incl = rt[:, None] >= rt[None, :]",
            "eye = (rt[:, None] == rt[None, :]).to(tl.float32)",
            "s_off = nh.to(tl.int64) * D * D + rk[:, None] * D + rv[None, :]",
        ])
        if has_initial_state:
            w.line("S = tl.load(s0 + s_off)")
        else:
            w.line("S = tl.zeros([D, BV], dtype=tl.float32)")
        w.line("for c0 in range(0, L, BT):")
        with w.indent():
            w.lines([
                "tok = c0 + rt",
                "tm = tok < L",
                "row = bos + tok",
                "m2 = tm[:, None]",
                "qc = tl.load(q + row[:, None] * sq + h * D + rk[None, :], mask=m2, other=0.0).to(tl.float32)",
                "kc = tl.load(k + row[:, None] * sk + h * D + rk[None, :], mask=m2, other=0.0).to(tl.float32)",
                "gc = tl.load(g + row[:, None] * sg + h * D + rk[None, :], mask=m2, other=0.0).to(tl.float32)",
                "vc = tl.load(v + row[:, None] * sv + h * D + rv[None, :], mask=m2, other=0.0).to(tl.float32)",
                "bc = tl.load(beta + row * sb + h, mask=tm, other=0.0).to(tl.float32)",
                "G = tl.cumsum(gc, axis=0)                       # Gamma (masked rows: g = 0)",
                f"Gm = tl.sum(tl.where(rt[:, None] == {BT // 2 - 1}, G, 0.0), axis=0)   # anchor row",
                "Gl = tl.sum(gc, axis=0)                         # Gamma at the chunk's last row",
                f"dm = tl.minimum(tl.maximum(G - Gm[None, :], {fnum(-EXP_CLAMP)}), {fnum(EXP_CLAMP)})",
                "ka = kc * tl.exp(dm)",
                "kb = kc * tl.exp(-dm)",
                f"akk = {dot('ka', 'tl.trans(kb)')}",
                f"aqk = {dot('qc * tl.exp(dm)', 'tl.trans(kb)')} * {fnum(scale)}",
                "akk = tl.where(strict, akk * bc[:, None], 0.0)",
                "aqk = tl.where(incl, aqk, 0.0)",
                "# (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... (A strictly lower triangular)",
                "tinv = eye - akk",
                "pw = akk",
            ])
            for _ in range(LOG - 1):
                w.line(f"pw = {dot('pw', 'pw', 'ieee')}")
                w.line(f"tinv = tinv + {dot('tinv', 'pw', 'ieee')}")
            w.lines([
                "eg = tl.exp(G)",
                f"wm = {dot('tinv', 'kc * eg * bc[:, None]')}",
                f"um = {dot('tinv', 'vc * bc[:, None]')}",
                f"vn = um - {dot('wm', 'S')}",
                f"oc = {dot('qc * eg', 'S')} * {fnum(scale)} + {dot('aqk', 'vn')}",
                f"tl.store(o + row[:, None] * {H * D} + h * D + rv[None, :], {to_dtype('oc', o_dtype, interp)}, mask=m2)",
                "kd = kc * tl.exp(Gl[None, :] - G)",
                f"S = S * tl.exp(Gl)[:, None] + {dot('tl.trans(kd)', 'vn')}",
            ])
        w.line("tl.store(sT + s_off, S)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const,
                        grid=("D // BV", "N * H"), num_warps=p.chunk_warps, num_stages=1,
                        ir_op=ir_op, loc=loc)


# ---- fused decode ---------------------------------------------------------------------------------------------
def emit_kda_decode(num_heads: int, head_dim: int, conv_kernel: int, *, gate: str, gate_lower_bound: float,
                    l2norm_eps: float, norm_eps: float, target: Target, dtype: str = "bf16",
                    scale: float | None = None, plan: KDAPlan | None = None, fuse_out: bool = True,
                    ir_op: str = "kda_decode", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """One token per sequence. Args: xq, xk, xv, xf [B, H*D], xb [B, H], xg [B, H*D] (output gate projection),
    wq, wk, wv [H*D, KW], a_log [H], dt_bias [H*D], nw [D] (o_norm weight), tq_in.. [B, H*D, KW-1] conv tails in,
    tq_out.. out (may alias the inputs), s_in, s_out [B, H, D, D] fp32 (may alias), y [B, H*D] (`dtype`), B.
    Grid (B * H, D // BV). With fuse_out one program holds a head's whole [D, D] state (the RMSNorm needs all of V);
    without it there are no xg / nw args, y [B, H*D] is the fp32 o (kda_out follows) and the V columns are split
    over D // plan.decode_block_v programs (more bytes in flight per SM). Split programs all read the q / k conv
    tails and the first one writes them: the q / k tails must not be updated in place then (v's may)."""
    H, D, KW = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim"), check_dim(conv_kernel, "conv")
    check_float(dtype)
    _check_gate(gate, gate_lower_bound)
    p = plan or kda_plan(D, dtype, target)
    ydt = dtype if fuse_out else "fp32"
    interp = interpreted(target, interpret)
    scale = D ** -0.5 if scale is None else float(scale)
    HD = H * D
    BV = D if fuse_out else _check_pow2(p.decode_block_v, "decode_block_v")
    if BV > D or BV < 16:
        raise CodegenError(f"decode_block_v must be in [16, head_dim], got {BV}")
    lanes = max(int(target.warp_size), 32)
    warps = p.decode_warps if BV == D else max(1, min(16, D * BV // (32 * lanes)))
    kname = ident(f"k3c_kda_decode_fwd_h{H}_d{D}_k{KW}_{gate}_{name_part(dtype)}"
                  + ("" if fuse_out else f"_noout_bv{BV}"))
    sig = {n: f"*{dtype}" for n in ("xq", "xk", "xv", "xf", "xb", *(("xg",) if fuse_out else ()), "wq", "wk", "wv")}
    sig.update({"a_log": "*fp32", "dt_bias": "*fp32", **({"nw": "*fp32"} if fuse_out else {})})
    sig.update({n: f"*{dtype}" for n in ("tq_in", "tk_in", "tv_in", "tq_out", "tk_out", "tv_out")})
    sig.update({"s_in": "*fp32", "s_out": "*fp32", "y": f"*{ydt}", "B": "i32"})
    const = {"H": H, "D": D, "KW": KW, "BV": BV}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda fused decode H={H} D={D} conv={KW} gate={gate} x:{dtype} BV={BV} warps={warps} "
                    f"output norm x gate fused: {fuse_out}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, sigmoid=True, rtne_bf16=interp and dtype == "bf16")
    with w.jit_function(kname, list(sig), list(const)):
        w.lines([
            "pid = tl.program_id(0)",
            "pv = tl.program_id(1)",
            "b = (pid // H).to(tl.int64)",
            "h = pid % H",
            "rk = tl.arange(0, D)",
            "rv = pv * BV + tl.arange(0, BV)",
        ])
        for x, wt, tin, tout, name in (("xq", "wq", "tq_in", "tq_out", "qv"), ("xk", "wk", "tk_in", "tk_out", "kv"),
                                       ("xv", "wv", "tv_in", "tv_out", "vv")):
            cols = "rv" if name == "vv" else "rk"
            w.line(f"col = h * D + {cols}")
            w.line(f"xo = b * {HD} + col")
            w.line("tb = xo * (KW - 1)")
            w.line(f"cur = tl.load({x} + xo)")
            w.line(f"acc = cur.to(tl.float32) * tl.load({wt} + col * KW + KW - 1).to(tl.float32)")
            for j in range(KW - 1):
                w.line(f"t{j} = tl.load({tin} + tb + {j})")
                w.line(f"acc += t{j}.to(tl.float32) * tl.load({wt} + col * KW + {j}).to(tl.float32)")
            if name != "vv" and BV < D:
                w.line("if pv == 0:")
            with w.indent(1 if name != "vv" and BV < D else 0):
                for j in range(KW - 2):
                    w.line(f"tl.store({tout} + tb + {j}, t{j + 1})")
                w.line(f"tl.store({tout} + tb + {KW - 2}, cur)")
            w.line(f"acc = {_round_like('acc', dtype, interp)}")
            w.line(f"{name} = {_round_like('acc * _k3c_sigmoid(acc)', dtype, interp)}")
            if name != "vv":
                w.line(f"{name} = {name} / tl.sqrt(tl.sum({name} * {name}, axis=0) + {fnum(l2norm_eps)})")
        w.lines([
            "colk = h * D + rk",
            f"f = tl.load(xf + b * {HD} + colk).to(tl.float32) + tl.load(dt_bias + colk)",
            "a = tl.exp(tl.load(a_log + h))",
        ])
        w.lines(_gate_lines(gate, gate_lower_bound, "f", "a", "gk"))
        w.lines([
            "beta = _k3c_sigmoid(tl.load(xb + b * H + h).to(tl.float32))",
            "s_off = pid.to(tl.int64) * D * D + rk[:, None] * D + rv[None, :]",
            "S = tl.load(s_in + s_off) * tl.exp(gk)[:, None]",
            "u = beta * (vv - tl.sum(kv[:, None] * S, axis=0))",
            "S = S + kv[:, None] * u[None, :]",
            f"o = tl.sum((qv * {fnum(scale)})[:, None] * S, axis=0)",
            "tl.store(s_out + s_off, S)",
        ])
        w.line(f"yo = b * {HD} + h * D + rv")
        if fuse_out:
            w.lines([
                f"o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + {fnum(norm_eps)}) * tl.load(nw + rv)",
                "o = o * _k3c_sigmoid(tl.load(xg + yo).to(tl.float32))",
            ])
        w.line(f"tl.store(y + yo, {to_dtype('o', ydt, interp)})")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const, grid=("B * H", "D // BV"),
                        num_warps=warps, num_stages=1, ir_op=ir_op, loc=loc)


# ---- output norm x gate ----------------------------------------------------------------------------------------
def emit_kda_out(num_heads: int, head_dim: int, *, norm_eps: float, target: Target, dtype: str = "bf16",
                 o_dtype: str = "fp32", ir_op: str = "kda_out", loc: str = "",
                 interpret: bool | None = None) -> KernelSource:
    """y = RMSNorm_head(o) * nw * sigmoid(gate). Args: o [M, H, D] (o_dtype), xg [M, H*D], nw [D] fp32,
    y [M, H*D] (`dtype`), M (rows = tokens). ROWS (token, head) rows per program: 2048 values per program on
    GPUs (16 rows of 128), 8192 in the interpreter (fewer, larger numpy steps). Grid (cdiv(M * H, ROWS),)."""
    H, D = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim")
    check_float(dtype)
    check_float(o_dtype)
    interp = interpreted(target, interpret)
    rows = max(1, (8192 if target.backend == "cpu" else 2048) // D)
    kname = ident(f"k3c_kda_out_fwd_h{H}_d{D}_{name_part(dtype)}")
    sig = {"o": f"*{o_dtype}", "xg": f"*{dtype}", "nw": "*fp32", "y": f"*{dtype}", "M": "i32"}
    const = {"D": D, "ROWS": rows}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda output norm x gate H={H} D={D} eps={fnum(norm_eps)} y:{dtype} ROWS={rows}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, sigmoid=True, rtne_bf16=interp and dtype == "bf16")
    with w.jit_function(kname, list(sig), list(const)):
        w.lines([
            "r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)",
            f"rm = (r < M * {H})[:, None]",
            "rd = tl.arange(0, D)",
            "off = r[:, None] * D + rd[None, :]",
            "x = tl.load(o + off, mask=rm, other=0.0).to(tl.float32)",
            f"x = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + {fnum(norm_eps)})[:, None] * tl.load(nw + rd)[None, :]",
            "x = x * _k3c_sigmoid(tl.load(xg + off, mask=rm, other=0.0).to(tl.float32))",
            f"tl.store(y + off, {to_dtype('x', dtype, interp)}, mask=rm)",
        ])
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const,
                        grid=(f"cdiv(M * {H}, ROWS)",), num_warps=4, num_stages=1, ir_op=ir_op, loc=loc)


__all__ = ["KDAPlan", "kda_plan", "emit_kda_prep", "emit_kda_chunk", "emit_kda_decode", "emit_kda_out"]
