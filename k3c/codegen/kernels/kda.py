"""Kimi Delta Attention kernels (K3.md section 2): input prep, chunked prefill, fused recurrent decode, output.

    emit_kda_prep    causal short conv (conv tails in / out) + SiLU for q, k, v; L2 norm of q, k; gate activation
                     (softplus or safe); beta = sigmoid(b). Writes two packed rows per token: [q | k | v] (H*D each,
                     fp32, or bf16 for bf16 models) and [g (H*D) | beta (H)] in fp32.
    emit_kda_intra   prefill, token-parallel half: per chunk of BT tokens (all chunks at once) k e^Gamma, q e^Gamma,
                     k e^(Gamma_C - Gamma), A_qk, T diag(beta) and e^Gamma_C (FlashKDA's split).
    emit_kda_inter   prefill, sequential half: one program per (sequence, head, V block) walks the chunks with only
                     the state-dependent matmuls; fp32 state in registers, initial state in / final state out,
                     variable lengths (cu_seqlens).
    emit_kda_decode  one token per sequence, everything fused: conv (tails updated), SiLU, L2 norm, gate, beta, the
                     delta-rule step on the fp32 state (in place allowed), per-head RMSNorm x sigmoid(output gate).
    emit_kda_out     per-head RMSNorm x sigmoid(output gate) for prefill.

Numerics of the prefill kernels (the reference's kda_chunked is exact through pairwise differences + a triangular
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
from dataclasses import dataclass, replace

from ..kernel import KernelSource
from ..targets import Target
from ..tiers import PORTABLE, tier_of
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part
from .common import check_dim, check_float, emit_math_helpers, interpreted, to_dtype
from .kda_hopper import K_SPLIT, emit_kda_inter_hopper, hopper_inter_problem

GATES = ("softplus", "safe")
DOT_MODES = ("ieee", "tf32", "bf16")
INTER_TIERS = (PORTABLE, "hopper")     # tiers with a state-passing kernel (hopper: kernels/kda_hopper.py)
# the decode step without its fused output norm (kda_out follows) still bakes an eps into its source
DECODE_NORM_EPS = 1e-5
EXP_CLAMP = 80.0          # |exponent| cap of the anchored intra-chunk factors (e^88 overflows fp32)
SUB = 16                  # tokens per intra-chunk sub-chunk: the unit of the anchored decays and of the inverse
# tokens per prep program on GPUs: 32 beat 16 by 1.24x and 64 by 1.04x at B=1 T=8192 H=96 (H100, docs/perf.md, KDA)
PREP_BLOCK_T = 32
MAX_CHECKPOINTS = 2       # states a prefill exports per sequence (emit_kda_inter; FlashKDA's fork exports two)


def _check_pow2(value: int, what: str) -> int:
    check_dim(value, what)
    if value & (value - 1):
        raise CodegenError(f"{what} must be a power of two, got {value}")
    return value


@dataclass(frozen=True)
class KDAPlan:
    """Block sizes of the KDA kernels for one target and head dim."""
    chunk: int            # BT: tokens per chunk step (sub-chunk of target.kda_chunk)
    block_v: int          # BV: V columns per state-passing program
    chunk_warps: int      # warps of the state-passing program
    prep_block_t: int     # tokens per prep program
    decode_warps: int     # warps of a decode program
    dot: str              # matmul precision of the chunk kernels' big products
    decode_block_v: int = 32   # V columns per decode slice (looped) or program (split)
    decode_split: bool = False  # decode: V slices over programs (True) or looped inside one program per head
    intra_warps: int = 4  # warps of the intra-chunk kernel
    inter_tier: str = PORTABLE  # the state-passing kernel's tier: "portable" (emit_kda_inter's Triton kernel) or
                                # "hopper" (kernels/kda_hopper.py, Gluon; opt-in until measured: docs/perf.md)
    inter_k_split: int = 1      # hopper tier: the state's K columns in this many parts (independent MMA chains)
    decode_tier: str = PORTABLE   # the decode step's kernel tier (kda_decode_hopper.py: "hopper")
    decode_lanes_k: int = 8       # hopper decode: lanes of a warp along K (8 or 32; the rest run along V)


def inter_dtype(dot: str) -> str:
    """dtype of the intra-chunk kernel's outputs (k e^Gamma, q e^Gamma, k e^(Gamma_C - Gamma), A_qk, T diag(beta)):
    the operand precision of the state-passing kernel's matmuls (bf16 products read bf16 operands; fp32 / tf32 keep
    fp32)."""
    return "bf16" if dot == "bf16" else "fp32"


def prep_qkv_dtype(dot: str) -> str:
    """dtype of the prep kernel's q / k / v rows, the chunk kernels' matmul operands: bf16 under bf16 products (half
    the bytes; the products round them anyway), else fp32. The catalogue and the runtime's launcher both ask here."""
    return "bf16" if dot == "bf16" else "fp32"


def run_dot(dtype: str, ir_dot: str) -> str:
    """The matmul precision a run uses: the IR's `dot` is chosen for the model's declared (bf16) activations; a run
    in fp32 gets exact fp32 products, which is what it is for (a bf16 dot there is far off the fp32 reference:
    docs/perf.md, "Plan rules")."""
    return "ieee" if dtype == "fp32" else ir_dot


def kda_plan(head_dim: int, dtype: str, target: Target, *, chunk: int | None = None, block_v: int | None = None,
             dot: str | None = None, chunk_warps: int | None = None,
             decode_block_v: int | None = None, decode_warps: int | None = None,
             decode_split: bool | None = None, intra_warps: int | None = None,
             inter_tier: str | None = None, inter_k_split: int | None = None, decode_tier: str | None = None,
             decode_lanes_k: int | None = None) -> KDAPlan:
    """Prefill: two kernels (FlashKDA's split): the intra-chunk kernel computes, for all chunks of BT tokens in
    parallel, k e^Gamma, q e^Gamma, k e^(Gamma_C - Gamma), A_qk, T diag(beta) and e^Gamma_C; the state-passing
    kernel walks the chunks
    of one (sequence, head, V block) with only the three state-dependent matmuls on its serial path. BT = 16 keeps the
    anchored decays exact at lb = -5 (32 is exact too, at the clamp's edge); BV / warps: see the defaults below.
    Decode: one program per (b, h) looping over V slices of 32 columns, 4 warps on 32-lane GPUs.
    inter_tier "hopper" asks for the Gluon state-passing kernel (kernels/kda_hopper.py: its warps own 16 V columns
    each, so chunk_warps defaults to BV / 16; inter_k_split defaults to kda_hopper.K_SPLIT); it is never the default
    (unmeasured), and a target without the hopper tier or a shape that kernel does not serve is refused.
    Overrides are for benchmarks and tests."""
    D = _check_pow2(head_dim, "head_dim")
    if D < 16:
        raise CodegenError(f"head_dim must be >= 16 for the KDA kernels, got {D}")
    bt = chunk if chunk is not None else min(int(target.kda_chunk), 16)
    _check_pow2(bt, "chunk")
    # 64-token chunks are exact in the interpreter but wrong on sm_90 (triton 3.6; docs/perf.md, KDA): not offered
    if not SUB <= bt <= 2 * SUB:
        raise CodegenError(f"KDA chunk step must be 16 or 32 tokens, got {bt}")
    lanes = max(int(target.warp_size), 32)
    # BV 64 beat 32 by 1.23x with the prefetch on the H200 (8 warps or BV 128: slower; docs/perf.md, KDA)
    bv = block_v if block_v is not None else min(D, 64)
    _check_pow2(bv, "block_v")
    if bv < 16 or bv > D:
        raise CodegenError(f"block_v must be in [16, head_dim], got {bv}")
    if dot is None:
        dot = "ieee" if dtype == "fp32" else "bf16"
    if dot not in DOT_MODES:
        raise CodegenError(f"dot precision must be one of {DOT_MODES}, got {dot!r}")
    # the state-passing kernel holds only the [D, BV] state and the step's operand tiles: 4 warps. The interpreter
    # runs a program as numpy ops (warps are irrelevant: 1)
    warps = chunk_warps if chunk_warps is not None else 4
    if target.backend == "cpu":
        warps = 1 if chunk_warps is None else warps
    dbv = min(D, decode_block_v if decode_block_v is not None else 32)
    _check_pow2(dbv, "decode_block_v")
    dwarps = decode_warps if decode_warps is not None else max(1, min(8, D * dbv // (32 * lanes)))
    if target.backend == "cpu" and decode_warps is None:
        dwarps = 1
    # intra-chunk kernel: BT = 32 holds [32, D] tiles and [32, 32] products: 8 warps (4 spill on sm_90). BT = 16:
    # 2 warps (255 registers on sm_90, spill-free) beat 4 by 1.32x and 8 by 3.7x on the H200 (docs/perf.md, KDA):
    # the kernel is latency-bound and more resident programs per SM hide it better than more threads per program
    iwarps = 1 if target.backend == "cpu" else (8 if bt * D >= 4096 else 2)
    if intra_warps is not None:
        iwarps = intra_warps
    tier = PORTABLE if inter_tier is None else inter_tier
    k_split = 1
    if tier == PORTABLE and inter_k_split not in (None, 1):
        raise CodegenError(f"inter_k_split={inter_k_split}: the portable state-passing kernel holds its state whole "
                           "(inter_k_split is a hopper-tier option)")
    if tier not in INTER_TIERS:
        raise CodegenError(f"inter_tier must be one of {INTER_TIERS}, got {tier!r}")
    if tier != PORTABLE:
        if not target.has_tier(tier):
            raise CodegenError(f"inter_tier {tier!r}: target {target.name} has no {tier} tier (its tiers: "
                               f"{', '.join(target.tiers) or 'none'})")
        if chunk_warps is None:
            warps = max(1, min(8, bv // 16))
        k_split = K_SPLIT if inter_k_split is None else inter_k_split
        why = hopper_inter_problem(D, bt, bv, warps, dot, target, k_split)
        if why:
            raise CodegenError(f"inter_tier {tier!r}: the Gluon state-passing kernel {why}")
    # the hopper decode is not the default until bench/kda.py has timed it on a GPU (docs/perf.md, KDA)
    dtier = decode_tier or PORTABLE
    if not target.has_tier(dtier):
        raise CodegenError(f"KDA decode tier {dtier!r} is not available on target {target.name} "
                           f"(its tiers: {', '.join((PORTABLE, *target.tiers))})")
    lanes_k = 8 if decode_lanes_k is None else decode_lanes_k
    if lanes_k not in (8, 32):
        raise CodegenError(f"decode_lanes_k must be 8 or 32, got {lanes_k}")
    return KDAPlan(bt, bv, warps, 64 if target.backend == "cpu" else PREP_BLOCK_T, dwarps, dot, dbv,
                   bool(decode_split), iwarps, tier, k_split, dtier, lanes_k)


# the prefill programs' (sequence, head) from grid dim 1 and the sequence's tokens [bos, bos + L) of the packed rows
_SEQUENCE_HEAD = (
    "nh = tl.program_id(1)",
    "n = nh // H",
    "h = nh % H",
    "bos = tl.load(cu + n).to(tl.int64)",
    "L = tl.load(cu + n + 1).to(tl.int64) - bos",
)


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
def prep_signature(dtype: str, qkv_dtype: str) -> dict[str, str]:
    """The prep kernel's arguments (emit_kda_prep's doc), for every tier's prep: one contract, one place."""
    sig = {n: f"*{dtype}" for n in ("xq", "xk", "xv", "xf", "xb", "wq", "wk", "wv")}
    sig.update({"a_log": "*fp32", "dt_bias": "*fp32"})
    sig.update({n: f"*{dtype}" for n in ("tq_in", "tk_in", "tv_in", "tq_out", "tk_out", "tv_out")})
    sig.update({"qkv": f"*{qkv_dtype}", "gb": "*fp32", "cu": "*i32", "N": "i32", "T_MAX": "i32"})
    return sig


def decode_signature(dtype: str, fuse_out: bool) -> dict[str, str]:
    """The decode step's arguments (emit_kda_decode's doc), for every tier's decode; y is fp32 without fuse_out."""
    sig = {n: f"*{dtype}" for n in ("xq", "xk", "xv", "xf", "xb", *(("xg",) if fuse_out else ()), "wq", "wk", "wv")}
    sig.update({"a_log": "*fp32", "dt_bias": "*fp32", **({"nw": "*fp32"} if fuse_out else {})})
    sig.update({n: f"*{dtype}" for n in ("tq_in", "tk_in", "tv_in", "tq_out", "tk_out", "tv_out")})
    sig.update({"s_in": "*fp32", "s_out": "*fp32", "y": f"*{dtype if fuse_out else 'fp32'}", "B": "i32"})
    return sig


def prep_role_pointers(w: SourceWriter) -> None:
    """The prep's q / k / v programs (role 0, 1, 2) pick their input, conv weight and tails: one body over all three
    (both tiers)."""
    w.line("if role == 0:")
    w.line("    x, wt, tin, tout = xq, wq, tq_in, tq_out")
    w.line("elif role == 1:")
    w.line("    x, wt, tin, tout = xk, wk, tk_in, tk_out")
    w.line("else:")
    w.line("    x, wt, tin, tout = xv, wv, tv_in, tv_out")


def prep_tail_update(w: SourceWriter, ns: str, HD: int, KW: int) -> None:
    """The prep's new conv tail, written by the first time block: the last KW-1 pre-conv inputs (older tail entries
    when the segment is short). ns: the dialect's module ("tl" Triton, "gl" Gluon)."""
    w.line("if tb == 0:")
    with w.indent():
        for j in range(KW - 1):
            w.lines([
                f"p{j} = rd.to({ns}.int64) * 0 + (L - (KW - 1) + {j})",
                f"n{j} = {ns}.load(x + (bos + p{j}) * {HD} + col, mask=p{j} >= 0, other=0.0)"
                f" + {ns}.load(tin + tail_base + (KW - 1 + p{j}), mask=p{j} < 0, other=0.0)",
            ])
        for j in range(KW - 1):
            w.line(f"{ns}.store(tout + tail_base + {j}, n{j})")


def emit_kda_prep(num_heads: int, head_dim: int, conv_kernel: int, *, gate: str, gate_lower_bound: float,
                  l2norm_eps: float, target: Target, dtype: str = "bf16", qkv_dtype: str = "fp32",
                  block_t: int | None = None, ir_op: str = "kda_prep", loc: str = "",
                  interpret: bool | None = None) -> KernelSource:
    """Args: xq, xk, xv, xf [total, H*D], xb [total, H] (projections, `dtype`), wq, wk, wv [H*D, KW] (conv weights),
    a_log [H], dt_bias [H*D], tq_in, tk_in, tv_in [N, H*D, KW-1] (conv tails, `dtype`), tq_out, tk_out, tv_out,
    qkv [total, 3*H*D] (`qkv_dtype`: bf16 halves the bytes for bf16 models, whose chunk matmuls take bf16 operands),
    gb [total, H*D + H] fp32 (g, beta), cu [N + 1] i32 (sequence starts), N, T_MAX. Grid
    (cdiv(T_MAX, BT) * N * H * 4,): q, k, v and g|beta programs."""
    H, D, KW = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim"), check_dim(conv_kernel, "conv")
    if KW < 2:
        raise CodegenError(f"conv_kernel must be >= 2, got {KW}")
    check_float(dtype)
    check_float(qkv_dtype, "qkv_dtype")
    _check_gate(gate, gate_lower_bound)
    interp = interpreted(target, interpret)
    BT = _check_pow2(block_t or kda_plan(D, dtype, target).prep_block_t, "block_t")
    HD = H * D
    kname = ident(f"k3c_kda_prep_fwd_h{H}_d{D}_k{KW}_{gate}_{name_part(dtype)}"
                  + ("" if qkv_dtype == "fp32" else f"_o{name_part(qkv_dtype)}") + f"_t{BT}")
    sig = prep_signature(dtype, qkv_dtype)
    const = {"H": H, "D": D, "KW": KW, "BT": BT}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda prep H={H} D={D} conv={KW} gate={gate} lb={fnum(gate_lower_bound)} x:{dtype} "
                    f"q/k/v out:{qkv_dtype} BT={BT}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, sigmoid=True, rtne_bf16=interp and "bf16" in (dtype, qkv_dtype))
    with w.jit_function(kname, list(sig), list(const)):
        # one program per (time block, sequence, head, role), roles then heads fastest: the programs resident at
        # once cover whole [tokens, H*D] rows instead of 256-byte pieces of one head at a 24 KB stride, and a 1-D
        # grid has no 65,535 limit on the time blocks of a long prompt. A role is one output: q, k, v (conv, SiLU,
        # L2 norm for q / k) or g|beta. One body serves q, k and v with the role's pointers: unrolled side by side
        # they kept every conv weight and shifted tile live at once (207 registers at 16 tokens on sm_90)
        w.lines([
            "pid = tl.program_id(0)",
            "role = pid % 4",
            "nh = (pid // 4) % (N * H)",
            "tb = pid // (4 * N * H)",
            "n = nh // H",
            "h = nh % H",
            "bos = tl.load(cu + n).to(tl.int64)",
            "L = tl.load(cu + n + 1).to(tl.int64) - bos",
            "t0 = tb.to(tl.int64) * BT",
            "rt = t0 + tl.arange(0, BT).to(tl.int64)",
            "tm = rt < L",
            "rd = tl.arange(0, D)",
            "col = h * D + rd",
            f"row = (bos + rt) * {HD}",
        ])
        w.line("if role < 3:")
        with w.indent():
            _emit_prep_conv_role(w, H, D, KW, dtype, qkv_dtype, l2norm_eps, interp)
        w.line("else:")
        with w.indent():
            _emit_prep_gate_role(w, H, D, gate, gate_lower_bound)
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const,
                        grid=("cdiv(T_MAX, BT) * N * H * 4",), num_warps=max(4, min(8, BT * D // 256)), num_stages=1,
                        ir_op=ir_op, loc=loc)


def _emit_prep_conv_role(w: SourceWriter, H: int, D: int, KW: int, dtype: str, qkv_dtype: str, l2norm_eps: float,
                         interp: bool) -> None:
    """The prep's q, k and v programs (role 0, 1, 2): one body over the role's pointers: causal conv, SiLU, the L2
    norm of q and k, the qkv row, and the new conv tail from the first time block."""
    HD = H * D
    prep_role_pointers(w)
    # tap j reads the row KW-1-j tokens back; rows before the segment start come from the conv tail, read
    # only by the time blocks that reach back that far (a scalar branch: the others issue no tail loads)
    w.lines([
        f"tail_base = (n.to(tl.int64) * {HD} + col) * (KW - 1)",
        "xp = x + row[:, None] + col[None, :]",
        "acc = tl.zeros([BT, D], dtype=tl.float32)",
    ])
    w.line("for j in tl.static_range(KW):")
    with w.indent():
        w.lines([
            f"xs = tl.load(xp - (KW - 1 - j) * {HD}, mask=tm[:, None] & (rt[:, None] >= KW - 1 - j), "
            "other=0.0)",
            "acc += xs.to(tl.float32) * tl.load(wt + col * KW + j).to(tl.float32)[None, :]",
        ])
    w.line("if t0 < KW - 1:")
    with w.indent():
        w.line("for j in tl.static_range(KW - 1):")
        with w.indent():
            w.lines([
                "p = rt - (KW - 1) + j",
                "intail = tm[:, None] & (p[:, None] < 0)",
                "ts = tl.load(tin + tail_base[None, :] + (KW - 1 + p)[:, None], mask=intail, other=0.0)",
                "acc += ts.to(tl.float32) * tl.load(wt + col * KW + j).to(tl.float32)[None, :]",
            ])
    w.line(f"acc = {_round_like('acc', dtype, interp)}")
    w.line(f"y = {_round_like('acc * _k3c_sigmoid(acc)', dtype, interp)}")
    w.line("if role < 2:")
    w.line(f"    y = y / tl.sqrt(tl.sum(y * y, axis=1) + {fnum(l2norm_eps)})[:, None]")
    w.line(f"tl.store(qkv + (bos + rt)[:, None] * {3 * HD} + role * {HD} + col[None, :], "
           f"{to_dtype('y', qkv_dtype, interp)}, mask=tm[:, None])")
    prep_tail_update(w, "tl", HD, KW)


def _emit_prep_gate_role(w: SourceWriter, H: int, D: int, gate: str, gate_lower_bound: float) -> None:
    """The prep's g|beta program (role 3): the gate from the forget projection, beta = sigmoid(b)."""
    HD, R = H * D, H * D + H
    w.lines([
        "f = tl.load(xf + row[:, None] + col[None, :], mask=tm[:, None], other=0.0)",
        "f = f.to(tl.float32) + tl.load(dt_bias + col)[None, :]",
        "a = tl.exp(tl.load(a_log + h))",
    ])
    w.lines(_gate_lines(gate, gate_lower_bound, "f", "a", "g"))
    w.lines([
        f"tl.store(gb + (bos + rt)[:, None] * {R} + col[None, :], g, mask=tm[:, None])",
        "bb = tl.load(xb + (bos + rt) * H + h, mask=tm, other=0.0).to(tl.float32)",
        f"tl.store(gb + (bos + rt) * {R} + {HD} + h, _k3c_sigmoid(bb), mask=tm)",
    ])


# ---- two-kernel prefill: intra-chunk (all chunks in parallel) + state passing (sequential over chunks) -----------
def _emit_sub_chunk(w: SourceWriter, i: int, dot, scale: float, single: bool, store_tiles) -> None:
    """Lines of sub-chunk i (rows row{i}, mask m{i}): its loads, Gamma from the chunk start (G{i}) and its anchored
    A_kk / A_qk blocks against sub-chunks j <= i (akk{j}, a{i}_{j}); _emit_sub_chunk_inverse then forms its row of
    T = (I + A_kk)^-1. e{j} is Gamma at the end of sub-chunk
    j (pass 1); the right factor of every block in column j, k_j e^(e_j - G_j), is rebuilt from k_j and g_j (L1 / L2
    hits) rather than kept: registers for all earlier sub-chunks would spill at 64-token chunks."""
    # q and k stay in their load dtype (bf16: half the registers) and widen at each use (exact)
    raw = "tl.load({p} + row{i}[:, None] * {s} + h * D + rk[None, :], mask=m{i}, other=0.0)"
    ld = raw + ".to(tl.float32)"
    w.lines([
        # the barrier keeps the compiler from hoisting this sub-chunk's loads above the previous one's work
        *(["tl.debug_barrier()"] if i else []),
        f"q{i} = " + raw.format(p="q", s="sq", i=i),
        f"k{i} = " + raw.format(p="k", s="sk", i=i),
        f"gt = {ld.format(p='g', s='sg', i=i)}",
        "gw = tl.cumsum(gt, axis=0)                      # Gamma from the sub-chunk start",
        *([f"e{i} = tl.sum(gt, axis=0)"] if single else []),
        f"b{i} = tl.load(beta + row{i} * sb + h, mask=tm{i}, other=0.0).to(tl.float32)",
        f"G{i} = gw" + (f" + e{i - 1}[None, :]" if i else "") + "                  # Gamma from the chunk start",
    ])
    # the [SUB, D] outputs go out before the products: Gamma (and q, k for sub-chunk 0) are dead during them
    store_tiles(i)
    w.lines([
        # diagonal block: anchor at the sub-chunk's middle row, each factor spans at most half of it
        f"gm = tl.sum(tl.where(rs[:, None] == {SUB // 2 - 1}, gw, 0.0), axis=0)",
        f"dm = tl.minimum(tl.maximum(gw - gm[None, :], {fnum(-EXP_CLAMP)}), {fnum(EXP_CLAMP)})",
        # the right factor is an operand of two dots: held in the operand dtype (bf16 dots: half the registers)
        f"kb = {dot.operand(f'k{i} * tl.exp(-dm)')}",
        f"akk = tl.where(strict, {dot(f'k{i} * tl.exp(dm)', 'tl.trans(kb)')} * b{i}[:, None], 0.0)",
        f"a{i}_{i} = tl.where(incl, {dot(f'q{i} * tl.exp(dm)', 'tl.trans(kb)')} * {fnum(scale)}, 0.0)",
        f"akk{i} = akk",
    ])
    if not i:
        return
    # off-diagonal blocks (i, j < i): anchor at the end of sub-chunk j, both factors have exponents <= 0
    w.lines([f"kw = k{i} * tl.exp(gw)", f"qw = q{i} * tl.exp(gw)"])
    for j in range(i):
        w.lines([
            f"kr = {ld.format(p='k', s='sk', i=j)}",
            f"kr = kr * tl.exp(e{j}[None, :] - tl.cumsum({ld.format(p='g', s='sg', i=j)}, axis=0)"
            + (f" - e{j - 1}[None, :]" if j else "") + ")",
            f"sc = tl.exp(e{i - 1} - e{j})[None, :]" if j < i - 1 else "sc = 1.0",
            f"akk{j} = {dot('kw * sc', 'tl.trans(kr)')} * b{i}[:, None]",
            f"a{i}_{j} = {dot('qw * sc', 'tl.trans(kr)')} * {fnum(scale)}",
        ])


def _emit_sub_chunk_inverse(w: SourceWriter, i: int, dot) -> None:
    """Row i of T = (I + A_kk)^-1 (blocks t{i}_{j}) from the A_kk blocks akk{j} of _emit_sub_chunk: T_ii by a 16 x 16
    Neumann product, T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj. Emitted after the sub-chunk's [SUB, D] tiles are stored,
    so they are dead here (2-warp programs then fit in 255 registers on sm_90 without spilling)."""
    w.lines([
        "# (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... (A strictly lower triangular)",
        f"t{i}_{i} = eye - akk{i}",
        f"pw = akk{i}",
    ])
    for _ in range(SUB.bit_length() - 2):
        w.line(f"pw = {dot('pw', 'pw', 'ieee')}")
        w.line(f"t{i}_{i} = t{i}_{i} + {dot(f't{i}_{i}', 'pw', 'ieee')}")
    for j in range(i - 1, -1, -1):
        terms = " + ".join(dot(f"akk{m}", f"t{m}_{j}", "ieee") for m in range(j, i))
        w.line(f"t{i}_{j} = -{dot(f't{i}_{i}', f'({terms})', 'ieee')}")


def emit_kda_intra(num_heads: int, head_dim: int, *, target: Target, qk_dtype: str = "fp32", g_dtype: str = "fp32",
                   beta_dtype: str = "fp32", scale: float | None = None, plan: KDAPlan | None = None,
                   ir_op: str = "kda_intra", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """The token-parallel half of the prefill: one program per (chunk of BT tokens, sequence x head).
    Args: q, k, g [*, H, D] rows at token stride sq / sk / sg (head stride D), beta (sb; head stride 1); outputs
    (dtype inter_dtype(plan.dot)) ko, qo, do [total, H, D]: K e^Gamma, scale Q e^Gamma, K e^(Gamma_C - Gamma);
    ao, to [total, H, BT]: rows of A_qk (scaled, causal) and of T diag(beta), T = (I + A_kk)^-1; eo [slots, H, D]
    fp32: e^Gamma_C (chunk c of sequence n at slot bos // BT + n + c, so slots = total // BT + N + 1); cu [N + 1]
    i32, N, T_MAX (longest sequence). Grid (cdiv(T_MAX, BT), N * H). V is not read: the state-passing kernel forms
    V_new = T diag(beta) (V - K e^Gamma S) itself (FlashKDA's split: W and U are never written).

    A chunk is BT / 16 sub-chunks of 16 tokens: the decays inside a sub-chunk are anchored at its middle row, those
    between sub-chunks i > j at the end of sub-chunk j, so no factor's exponent leaves [-80, 40] with the safe gate
    at any chunk size; the inverse is block triangular (16 x 16 Neumann products on the diagonal, block forward
    substitution below it)."""
    H, D = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim")
    for d in (qk_dtype, g_dtype, beta_dtype):
        check_float(d)
    p = plan or kda_plan(D, qk_dtype, target)
    interp = interpreted(target, interpret)
    scale = D ** -0.5 if scale is None else float(scale)
    BT = p.chunk
    NS = BT // SUB
    idt = inter_dtype(p.dot)
    kname = ident(f"k3c_kda_intra_fwd_h{H}_d{D}_bt{BT}_w{p.intra_warps}_{p.dot}_{name_part(qk_dtype)}")
    sig = {"q": f"*{qk_dtype}", "k": f"*{qk_dtype}", "g": f"*{g_dtype}", "beta": f"*{beta_dtype}",
           "ko": f"*{idt}", "qo": f"*{idt}", "do": f"*{idt}", "ao": f"*{idt}", "to": f"*{idt}", "eo": "*fp32",
           "cu": "*i32", "sq": "i32", "sk": "i32", "sg": "i32", "sb": "i32", "N": "i32", "T_MAX": "i32"}
    const = {"H": H, "D": D, "BT": BT}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda intra-chunk H={H} D={D} BT={BT} ({NS} sub-chunks of {SUB}) dot={p.dot} out:{idt} "
                    f"q/k:{qk_dtype} scale={fnum(scale)}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and idt == "bf16")

    def dot(a, b, mode=p.dot):
        return _dot(a, b, mode, interp)
    # a value kept for several bf16 dots is converted once
    dot.operand = (lambda e: f"({e}).to(tl.bfloat16)") if p.dot == "bf16" and not interp else (lambda e: e)

    def st(ptr, off, val, mask):
        w.line(f"tl.store({ptr} + {off}, {to_dtype(val, idt, interp)}, mask={mask})")

    with w.jit_function(kname, list(sig), list(const)):
        w.lines([
            "c = tl.program_id(0)",
            *_SEQUENCE_HEAD,
            "c0 = c.to(tl.int64) * BT",
        ])
        # the grid covers the longest sequence: a shorter one's programs past its end do nothing
        w.line("if c0 >= L:")
        with w.indent():
            w.line("return")
        w.lines([
            f"rs = tl.arange(0, {SUB})",
            "rk = tl.arange(0, D)",
            "strict = rs[:, None] > rs[None, :]",
            "incl = rs[:, None] >= rs[None, :]",
            "eye = (rs[:, None] == rs[None, :]).to(tl.float32)",
        ])
        if NS > 1:
            # pass 1: Gamma at the end of every sub-chunk (the anchors between sub-chunks, and Gamma_C)
            w.lines([
                "rc = tl.arange(0, BT)",
                "gs = tl.load(g + (bos + c0 + rc)[:, None] * sg + h * D + rk[None, :], mask=(c0 + rc < L)[:, None], "
                "other=0.0).to(tl.float32)",
            ])
        for i in range(NS):
            w.lines([
                f"tm{i} = c0 + {i * SUB} + rs < L",
                f"row{i} = bos + c0 + {i * SUB} + rs",
                f"m{i} = tm{i}[:, None]",
                *([f"e{i} = tl.sum(tl.where(rc[:, None] < {(i + 1) * SUB}, gs, 0.0), axis=0)"] if NS > 1 else []),
            ])
        def store_tiles(i):
            w.lines([f"o_off = row{i}[:, None] * {H * D} + h * D + rk[None, :]", f"eg = tl.exp(G{i})"])
            st("ko", "o_off", f"k{i} * eg", f"m{i}")
            st("qo", "o_off", f"q{i} * eg * {fnum(scale)}", f"m{i}")
            st("do", "o_off", f"k{i} * tl.exp(e{NS - 1}[None, :] - G{i})", f"m{i}")

        for i in range(NS):
            _emit_sub_chunk(w, i, dot, scale, NS == 1, store_tiles)
            _emit_sub_chunk_inverse(w, i, dot)
            w.line(f"r_off = row{i}[:, None] * {H * BT} + h * BT + rs[None, :]")
            for j in range(NS):
                zero = f"tl.zeros([{SUB}, {SUB}], dtype=tl.float32)"
                st("ao", f"r_off + {j * SUB}", f"a{i}_{j}" if j <= i else zero, f"m{i}")
                st("to", f"r_off + {j * SUB}", f"t{i}_{j} * b{j}[None, :]" if j <= i else zero, f"m{i}")
        w.line("slot = bos // BT + n + c")
        w.line(f"tl.store(eo + (slot * H + h) * D + rk, tl.exp(e{NS - 1}))")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const,
                        grid=("cdiv(T_MAX, BT)", "N * H"), num_warps=p.intra_warps, num_stages=1,
                        ir_op=ir_op, loc=loc)


def _inter_loads(at: str, x: str, H: int, D: int, BT: int, op_dt: str) -> list[str]:
    """The state-passing kernel's loads of the chunk at token offset `at` (names suffixed `x`): its rows' operands,
    zeros past the sequence's end."""
    return [
        f"row{x} = bos + ({at}) + rt",
        f"m2{x} = (({at}) + rt < L)[:, None]",
        f"kof = row{x}[:, None] * {H * D} + h * D + rk[None, :]",
        f"rof = row{x}[:, None] * {H * BT} + h * BT + rt[None, :]",
        f"kg{x} = tl.load(ki + kof, mask=m2{x}, other=0.0).to({op_dt})",
        f"qg{x} = tl.load(qi + kof, mask=m2{x}, other=0.0).to({op_dt})",
        f"kd{x} = tl.load(di + kof, mask=m2{x}, other=0.0).to({op_dt})",
        f"vc{x} = tl.load(v + row{x}[:, None] * sv + h * D + rv[None, :], mask=m2{x}, other=0.0).to(tl.float32)",
        f"aq{x} = tl.load(ai + rof, mask=m2{x}, other=0.0).to({op_dt})",
        f"tb{x} = tl.load(ti + rof, mask=m2{x}, other=0.0).to({op_dt})",
        f"eG{x} = tl.load(ei + ((slot0 + ({at}) // BT) * H + h) * D + rk, "
        f"mask=rk < tl.minimum(L - ({at}), 1) * D, other=0.0)",
    ]


def emit_kda_inter(num_heads: int, head_dim: int, *, target: Target, v_dtype: str = "fp32", o_dtype: str = "fp32",
                   plan: KDAPlan | None = None, has_initial_state: bool = True, checkpoints: int = 0,
                   ir_op: str = "kda_inter", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """The sequential half of the prefill: one program per (V block, sequence x head) walks the chunks:
        V_new = T diag(beta) (V - K e^Gamma S);  O = (scale Q e^Gamma) S + A_qk V_new;
        S = diag(e^Gamma_C) S + (K e^(Gamma_C - Gamma))^T V_new
    Args: ki, qi, di [total, H, D], ai, ti [total, H, BT], ei [slots, H, D] fp32 (emit_kda_intra's outputs), v
    [*, H, D] rows at token stride sv (head stride D, v_dtype), o [total, H, D] (o_dtype), s0 / sT [N, H, D, D]
    fp32 (s0 read when has_initial_state; may alias sT), cu, N. Grid (D // BV, N * H).
    checkpoints C > 0 (portable tier): also ck i32 [N, C], each sequence's token offsets whose state it exports
    (multiples of BT inside the sequence; -1: none), and sk fp32 [N, C, H, D, D], the state after those tokens
    (what a prefix checkpoint or a rollback inside the prefill keeps, without splitting the prefill there).
    A plan whose inter_tier is not "portable" gets that tier's kernel (same signature, outputs and grid), so the
    catalogue and the runtime swap the two by plan alone."""
    H, D = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim")
    check_float(o_dtype)
    check_float(v_dtype, "v_dtype")
    p = plan or kda_plan(D, "fp32", target)
    interp = interpreted(target, interpret)
    if checkpoints < 0 or checkpoints > MAX_CHECKPOINTS:
        raise CodegenError(f"kda state passing: 0..{MAX_CHECKPOINTS} checkpoints per sequence, got {checkpoints}")
    if checkpoints and p.inter_tier != PORTABLE:
        raise CodegenError(f"kda state passing: checkpoint states are written by the portable tier only (plan "
                           f"{p.inter_tier})")
    if p.inter_tier != PORTABLE:
        if interp:
            raise CodegenError(f"kda state passing: the {p.inter_tier} tier's Gluon kernel does not run in "
                               "Triton's interpreter (plan the portable tier there)")
        tier = tier_of(p.inter_tier)
        ks = emit_kda_inter_hopper(H, D, target=target, chunk=p.chunk, block_v=p.block_v, warps=p.chunk_warps,
                                   k_split=p.inter_k_split, dot=p.dot, v_dtype=v_dtype, o_dtype=o_dtype,
                                   has_initial_state=has_initial_state, ir_op=ir_op, loc=loc)
        return replace(ks, tier=tier.name, builds_with=tier.builds_with)
    BT, BV = p.chunk, p.block_v
    idt = inter_dtype(p.dot)
    kname = ident(f"k3c_kda_inter_fwd_h{H}_d{D}_bt{BT}_bv{BV}_w{p.chunk_warps}_{p.dot}"
                  f"_v{name_part(v_dtype)}" + ("" if has_initial_state else "_nos0")
                  + (f"_ck{checkpoints}" if checkpoints else ""))
    sig = {"ki": f"*{idt}", "qi": f"*{idt}", "di": f"*{idt}", "ai": f"*{idt}", "ti": f"*{idt}", "ei": "*fp32",
           "v": f"*{v_dtype}", "o": f"*{o_dtype}", "s0": "*fp32", "sT": "*fp32", "cu": "*i32", "sv": "i32",
           "N": "i32"}
    if checkpoints:
        sig.update({"ck": "*i32", "sk": "*fp32"})
    const = {"H": H, "D": D, "BT": BT, "BV": BV}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda state passing H={H} D={D} BT={BT} BV={BV} dot={p.dot} in:{idt} v:{v_dtype} "
                    f"warps={p.chunk_warps} o:{o_dtype}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and o_dtype == "bf16")
    op_dt = "tl.bfloat16" if p.dot == "bf16" and not interp else "tl.float32"

    def dot(a, b):
        if interp or p.dot != "bf16":
            return _dot(a, b, p.dot, interp)
        return f"tl.dot({a}, {b})"          # operands already bf16

    with w.jit_function(kname, list(sig), list(const)):
        w.lines([
            "pv = tl.program_id(0)",
            *_SEQUENCE_HEAD,
            "rt = tl.arange(0, BT)",
            "rk = tl.arange(0, D)",
            "rv = pv * BV + tl.arange(0, BV)",
            "s_off = nh.to(tl.int64) * D * D + rk[:, None] * D + rv[None, :]",
            "slot0 = bos // BT + n",
        ])
        w.line("S = tl.load(s0 + s_off)" if has_initial_state else "S = tl.zeros([D, BV], dtype=tl.float32)")
        w.lines([f"ck{j} = tl.load(ck + n * {checkpoints} + {j})" for j in range(checkpoints)])

        step = [
            f"Sb = S.to({op_dt})",
            f"xb = (vc - {dot('kg', 'Sb')}).to({op_dt})",
            f"vb = {dot('tb', 'xb')}.to({op_dt})",
            f"oc = {dot('qg', 'Sb')} + {dot('aq', 'vb')}",
            f"tl.store(o + row[:, None] * {H * D} + h * D + rv[None, :], {to_dtype('oc', o_dtype, interp)}, "
            "mask=m2)",
            f"S = S * eG[:, None] + {dot('tl.trans(kd)', 'vb')}",
        ]
        # register double buffer: chunk c + 1's loads are issued before chunk c's serial matmul chain, so their
        # latency hides behind it (a plain loop issues them after it; tl.range's pipelining was slower: docs/perf.md)
        w.lines(_inter_loads("0", "", H, D, BT, op_dt))
        w.line("for c0 in range(0, L, BT):")
        with w.indent():
            w.lines(_inter_loads("c0 + BT", "_n", H, D, BT, op_dt))
            w.lines(step)
            for j in range(checkpoints):        # the state after this chunk, where a checkpoint asks for it
                w.line(f"if c0 + BT == ck{j}:")
                w.line(f"    tl.store(sk + (n * {checkpoints} + {j}).to(tl.int64) * {H * D * D} + s_off - "
                       f"n.to(tl.int64) * {H * D * D}, S)")
            w.lines([f"{x} = {x}_n" for x in ("row", "m2", "kg", "qg", "kd", "vc", "aq", "tb", "eG")])
        w.line("tl.store(sT + s_off, S)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const,
                        grid=("D // BV", "N * H"), num_warps=p.chunk_warps, num_stages=1,
                        ir_op=ir_op, loc=loc)


# ---- fused decode ---------------------------------------------------------------------------------------------
class _DecodeConv:
    """The decode step's causal short conv + SiLU of one token (emit), and the conv tails it shifts: their writes
    are deferred to the end of the program (store_tails), after every read."""

    def __init__(self, w: SourceWriter, hd: int, kw: int, dtype: str, interp: bool):
        self.w, self.hd, self.kw, self.dtype, self.interp = w, hd, kw, dtype, interp
        self.pending: list[tuple[str, str, str]] = []      # (tail out, offset, value)

    def emit(self, x: str, wt: str, tin: str, tout: str, name: str, cols: str, tag: str) -> None:
        w, HD, KW = self.w, self.hd, self.kw
        w.line(f"col = h * D + {cols}")
        w.line(f"xo = b * {HD} + col")
        w.line(f"tb{tag} = xo * (KW - 1)")
        w.line(f"c{tag} = tl.load({x} + xo)")
        w.line(f"acc = c{tag}.to(tl.float32) * tl.load({wt} + col * KW + KW - 1).to(tl.float32)")
        for j in range(KW - 1):
            w.line(f"t{tag}_{j} = tl.load({tin} + tb{tag} + {j})")
            w.line(f"acc += t{tag}_{j}.to(tl.float32) * tl.load({wt} + col * KW + {j}).to(tl.float32)")
        for j in range(KW - 2):
            self.pending.append((tout, f"tb{tag} + {j}", f"t{tag}_{j + 1}"))
        self.pending.append((tout, f"tb{tag} + {KW - 2}", f"c{tag}"))
        w.line(f"acc = {_round_like('acc', self.dtype, self.interp)}")
        w.line(f"{name} = {_round_like('acc * _k3c_sigmoid(acc)', self.dtype, self.interp)}")

    def store_tails(self, split: bool) -> None:
        """The new tails, after a barrier: a replicated element (more threads than columns) is read by one thread
        and written by another, so every read of the program must be done before any in-place write. In the split
        layout only V-slice program 0 writes the q / k tails (every program reads them)."""
        w = self.w
        w.line("tl.debug_barrier()")
        for tout, off, val in self.pending:
            if split and not val.startswith(("tv", "cv")):
                w.line("if tl.program_id(1) == 0:")
                with w.indent():
                    w.line(f"tl.store({tout} + {off}, {val})")
            else:
                w.line(f"tl.store({tout} + {off}, {val})")


def _emit_decode_qk_gate(w: SourceWriter, conv: _DecodeConv, gate: str, lb: float, l2norm_eps: float,
                         scale: float, HD: int) -> None:
    """The decode step's per-head inputs: q, k (conv, SiLU, L2 norm; q scaled), the decay e^g and beta."""
    # q / k over the whole K dim: read every tail before anything is written (in-place tails are safe)
    for x, wt, tin, tout, name in (("xq", "wq", "tq_in", "tq_out", "qv"), ("xk", "wk", "tk_in", "tk_out", "kv")):
        conv.emit(x, wt, tin, tout, name, "rk", name[0])
        w.line(f"{name} = {name} / tl.sqrt(tl.sum({name} * {name}, axis=0) + {fnum(l2norm_eps)})")
    w.line(f"qv = qv * {fnum(scale)}")
    w.lines([
        "colk = h * D + rk",
        f"f = tl.load(xf + b * {HD} + colk).to(tl.float32) + tl.load(dt_bias + colk)",
        "a = tl.exp(tl.load(a_log + h))",
    ])
    w.lines(_gate_lines(gate, lb, "f", "a", "gk"))
    w.lines(["eg = tl.exp(gk)[:, None]",
             "beta = _k3c_sigmoid(tl.load(xb + b * H + h).to(tl.float32))"])


def _emit_decode_output(w: SourceWriter, NS: int, HD: int, norm_eps: float | None, ydt: str, interp: bool) -> None:
    """Store the NS o slices of one head; with norm_eps, the per-head RMSNorm x sigmoid(output gate) first."""
    w.line(f"yb = b * {HD} + h * D")
    if norm_eps is not None:
        w.line("ss = " + " + ".join(f"tl.sum(o{j} * o{j}, axis=0)" for j in range(NS)))
        w.line(f"rinv = tl.rsqrt(ss / D + {fnum(norm_eps)})")
        for j in range(NS):
            w.line(f"o{j} = o{j} * rinv * tl.load(nw + rv{j}) * _k3c_sigmoid(tl.load(xg + yb + rv{j}).to(tl.float32))")
    for j in range(NS):
        w.line(f"tl.store(y + yb + rv{j}, {to_dtype(f'o{j}', ydt, interp)})")


def emit_kda_decode(num_heads: int, head_dim: int, conv_kernel: int, *, gate: str, gate_lower_bound: float,
                    l2norm_eps: float, norm_eps: float, target: Target, dtype: str = "bf16",
                    scale: float | None = None, plan: KDAPlan | None = None, fuse_out: bool = True,
                    ir_op: str = "kda_decode", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """One token per sequence. Args: xq, xk, xv, xf [B, H*D], xb [B, H], xg [B, H*D] (output gate projection),
    wq, wk, wv [H*D, KW], a_log [H], dt_bias [H*D], nw [D] (o_norm weight), tq_in.. [B, H*D, KW-1] conv tails in,
    tq_out.. out, s_in, s_out [B, H, D, D] fp32 (may alias), y [B, H*D] (`dtype`), B. Without fuse_out there are no
    xg / nw args and y [B, H*D] is the fp32 o (kda_out follows).

    Two layouts (plan.decode_split):
      * looped (default): one program per (b, h) walks the V columns in slices of BV = plan.decode_block_v
        (unrolled), loading slice j+1 before it updates and stores slice j; the o slices stay in registers, so the
        per-head RMSNorm x gate fuses (fuse_out) and the conv tails update in place (one program owns them).
      * split: grid (B*H, D // BV), one slice per program (as fla's fused_recurrent). Every program reads the q / k
        conv tails and the first one writes them: q / k tails must not be updated in place (v's may); no fuse_out.
    Both issue the first state load before any other work, so the 8 D^2 state bytes stream while the prep runs."""
    H, D, KW = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim"), check_dim(conv_kernel, "conv")
    check_float(dtype)
    _check_gate(gate, gate_lower_bound)
    p = plan or kda_plan(D, dtype, target)
    ydt = dtype if fuse_out else "fp32"
    interp = interpreted(target, interpret)
    scale = D ** -0.5 if scale is None else float(scale)
    HD = H * D
    BV = min(_check_pow2(p.decode_block_v, "decode_block_v"), D)
    if BV < 8:
        raise CodegenError(f"decode_block_v must be in [8, head_dim], got {BV}")
    split = bool(p.decode_split) and not fuse_out and BV < D
    NS = 1 if split else D // BV
    warps = p.decode_warps
    kname = ident(f"k3c_kda_decode_fwd_h{H}_d{D}_k{KW}_{gate}_{name_part(dtype)}_bv{BV}_w{warps}"
                  + ("_split" if split else "") + ("" if fuse_out else "_noout"))
    sig = decode_signature(dtype, fuse_out)
    const = {"H": H, "D": D, "KW": KW, "BV": BV}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda fused decode H={H} D={D} conv={KW} gate={gate} x:{dtype} BV={BV} warps={warps} "
                    f"{'V split over programs' if split else f'{NS} V slices per program'} "
                    f"output norm x gate fused: {fuse_out}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, sigmoid=True, rtne_bf16=interp and dtype == "bf16")
    conv = _DecodeConv(w, HD, KW, dtype, interp)
    with w.jit_function(kname, list(sig), list(const)):
        w.lines([
            "pid = tl.program_id(0)",
            "b = (pid // H).to(tl.int64)",
            "h = pid % H",
            "rk = tl.arange(0, D)",
            "s_base = pid.to(tl.int64) * D * D + rk[:, None] * D",
        ])
        if split:
            w.line("rv0 = tl.program_id(1) * BV + tl.arange(0, BV)")
        else:
            for j in range(NS):
                w.line(f"rv{j} = {j * BV} + tl.arange(0, BV)")
        w.line("S0 = tl.load(s_in + s_base + rv0[None, :])       # first state slice in flight during the prep")
        _emit_decode_qk_gate(w, conv, gate, gate_lower_bound, l2norm_eps, scale, HD)
        for j in range(NS):
            if j + 1 <= NS - 1:
                w.line(f"S{j + 1} = tl.load(s_in + s_base + rv{j + 1}[None, :])   # next slice in flight")
            conv.emit("xv", "wv", "tv_in", "tv_out", "vv", f"rv{j}", f"v{j}")
            w.lines([
                f"S = S{j} * eg",
                "u = beta * (vv - tl.sum(kv[:, None] * S, axis=0))",
                "S = S + kv[:, None] * u[None, :]",
                f"o{j} = tl.sum(qv[:, None] * S, axis=0)",
                f"tl.store(s_out + s_base + rv{j}[None, :], S)",
            ])
        _emit_decode_output(w, NS, HD, norm_eps if fuse_out else None, ydt, interp)
        conv.store_tails(split)
    grid = ("B * H", "D // BV") if split else ("B * H",)
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const, grid=grid,
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


__all__ = ["run_dot", "DECODE_NORM_EPS",
           "KDAPlan", "kda_plan", "inter_dtype", "emit_kda_prep", "emit_kda_intra", "emit_kda_inter",
           "emit_kda_decode", "emit_kda_out"]
