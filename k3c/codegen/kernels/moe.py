"""(Latent)MoE kernels (K3.md sections 5 and 6): routing, grouped expert GEMMs over the permuted tokens, combine.

Routing (four launches, deterministic: no atomics, the permutation is the stable sort of the (token, k) slots by
expert, as torch.argsort(stable=True) gives):
    emit_moe_topk     a block of tokens per program: scores (sigmoid or softmax) of the fp32 router logits, top-k of
                      score + bias by k rounds of arg-max (ties -> lowest expert), weights renormalised and scaled;
                      writes weights f32 [N, k], ids i32 [N, k] and the presence rows i32 [N, E_local] (1 where the
                      token picked that local expert).
    emit_moe_rank     one program per block of local experts: exclusive prefix count of the presence matrix down the
                      tokens (in place: rank of the token among the expert's tokens) and the per-expert counts.
    emit_moe_offsets  one program: expert row offsets and M-tile offsets per BLOCK_M bucket (exclusive scans).
    emit_moe_scatter  a block of tokens per program: perm[offset[e] + rank(t, e)] = t * k + j for each local slot.
Since the k experts of one token are distinct, rank(t, e) = #tokens before t that picked e, so no two slots collide.

Grouped GEMM (`emit_moe_gemm`), all experts in one launch: grid (tile slots, N tiles). The tile schedule comes from
the routing's tile offsets for the kernel's BLOCK_M (emit_moe_offsets): expert = #(tile ends <= tile), one vector
compare over the experts; programs past the last tile exit. The tile-slot bound min(cdiv(S, BLOCK_M) +
E, S) (every expert adds at most one partial tile, every tile holds a row; `tile_slots`) needs no host sync.
    gate_up  A rows gathered through perm (token = slot // k), out = act(A W1^T, A W3^T) in permuted order.
    down     A = the gate_up output (permuted order), out rows scattered back to slot order (row t * k + j).
    dense    plain C = A W^T (no routing): the MXFP4 x bf16 GEMM for other quantized linears (same template).
The kernel is composed of parts (`GroupedGemm`: the checked shapes, dtypes and form): the tile's rows
(emit_tile_rows), the K loop with the B operand of the weight format (emit_mma_mainloop with operand_form's pointers
and K step; or the GEMV body), the epilogue (emit_mma_epilogue: GLU or plain, scattered or in place).
Weight formats (`mx`):
    none     bf16 / fp32 weights [E, N, K], tl.dot.
    upcast   MXFP4 packed u8 [E, N, K/2] + E8M0 scales u8 [E, N, K/32] (k3c.quant layout: element 2i in the low
             nibble), for sm_90 and gfx942 (no MX matrix units). Per 32-block of K, the packed bytes are decoded in
             registers by bit placement to fp16 holding value x 2^-14 (exact; 1.75 integer ops per element with
             CUDA's prmt/lop3, 5 in plain Triton elsewhere), multiplied by the block's 2^(s - 113) in fp32 and
             rounded to bf16 (exact: E2M1 values have 2 significant bits). The forms the plan picks by rows per
             expert (moe_gemm_plan; rules DEQUANT_MIN_ROWS, GEMV_MAX_ROWS, PAIRS_MAX_ROWS; the measurements behind
             them: docs/perf.md, "MoE plan measurements"):
               gemv     (decode, <= GEMV_MAX_ROWS rows) a 16-row tile's real rows, 1-4 at a time, FMAs against the
                        decoded K-contiguous tile (16-byte loads), each 32-block's partial sum scaled once; no MMA.
               joined   (MMA) the scaled nibbles interleaved back into a [BLOCK_N, BLOCK_K] tile (tl.join), one
                        dot per K step with contiguous activation loads (mma.sync at 16-32 rows, wgmma at 64+).
               pairs    (decode, <= PAIRS_MAX_ROWS rows, CUDA with bf16 activations; the default there) the joined
                        form with the packed tile loaded as 32-bit words and each byte decoded in PTX straight to
                        the bf16x2 K pair the MMA operand holds, the block scale applied by bf16x2 multiplies
                        (exact; one multiply where every scale of the weights is <= 128, else two): fewer
                        instructions per weight in the K loop than gemv / joined; 4-warp 16-row tiles, 256-K steps.
                        swap (option) makes the weight tile the MMA's A operand.
               lanes    (sm_90, plan option, not a default) the weight tile as wgmma's register A operand, the
                        payload in the load-time lanes layout (moe_lanes; every lane's bytes contiguous, words in the
                        perm bit order: one prmt + one and per K pair), activations wgmma's B from shared memory,
                        acc [BLOCK_N, BLOCK_M]; 3.1-3.3 SASS per weight at decode tiles against the pairs form's
                        4.1-4.5, 1.27-1.34x the default plans at 64-128 rows per expert (docs/perf.md, issue 24).
               hopper   (sm_90 targets, the default there: routed experts in the load-time hopper layout, which
                        weight preparation makes and no other form reads; moe_hopper) the weight tile as wgmma's
                        register A operand, one plan over all rows (_hopper_plan), the decode 11 integer ops per 8
                        weights + one bf16x2 scale multiply per pair; 2.85-2.92 SASS per weight at decode tiles
                        (docs/perf.md, issue 54).
               dequant  (prefill, >= DEQUANT_MIN_ROWS rows) emit_moe_dequant writes the experts' bf16 weights once
                        per call (chunks of experts within DEQUANT_WORKSPACE_BYTES), then the bf16 grouped GEMM
                        with expert_chunk runs those experts' tiles: the decode is not repeated per M tile.
    e4m3     native (target.native_mxfp4): A is quantized per 32 columns to MXFP8 in registers (OCP floor rule, as
             k3c.quant.mxfp8_quantize: scale = floor(log2 amax) - 8, elements saturated to +-448, round to nearest
             even) and tl.dot_scaled(e4m3, e2m1) runs on v_mfma_scale_f32_*_f8f6f4 (gfx950) / tcgen05.mma
             kind::mxf8f6f4 (sm_100).
    e2m1     native with MXFP4 activations (OCP floor rule, scale = floor(log2 amax) - 2, saturate +-6): the
             fp4 x fp4 form, tcgen05.mma kind::mxf4 on sm_100, v_mfma_scale_*_f8f6f4 on gfx950.
Combine (`emit_moe_combine`): one program per (token, column block), out = sum_j w[t, j] Y[t k + j] in fp32, k order,
+ residual (the shared experts when nothing sits between); with expert parallelism, slots of other ranks' experts
are skipped (their rows are never written). A gather, not an atomic scatter in the down GEMM's epilogue: it is
deterministic, needs no zeroed fp32 buffer, and rounds like the reference (Y in the activation dtype).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part, num
from .moe_hopper import (HOPPER_DECODE_ASM, HOPPER_DECODE_EXACT_ASM, HOPPER_K, HOPPER_ROWS, hopper_pointers,
                         hopper_step)
from .moe_lanes import (E2M1_PAIRS1_PERM_ASM, E2M1_PAIRS_PERM_ASM, LANES_GROUP_K, LANES_ROWS, lanes_pointers,
                        lanes_step, ptx_text)
from .common import (ELEM_BYTES, TL_DTYPE, check_dim, check_float, emit_math_helpers, glu_act, glu_helpers,
                     glu_lines, interpreted, pow2_ceil, to_dtype)

MX_MODES = ("none", "upcast", "e4m3", "e2m1")
KINDS = ("gate_up", "down", "dense")
ROW_BUCKETS = (16, 32, 64, 128)     # BLOCK_M choices of the grouped GEMM (rows per expert, rounded up)


def row_bucket(rows: int) -> int:
    """BLOCK_M for an expected `rows` per expert (or per dense GEMM)."""
    return max(ROW_BUCKETS[0], min(ROW_BUCKETS[-1], pow2_ceil(max(1, rows))))


def mx_mode(expert_format: str, target: Target, activation_format: str | None = None, mx: str = "auto") -> str:
    """How MXFP4 weights run on `target` (mx "auto"; anything else is taken as given): natively through
    tl.dot_scaled where the target has MX matrix units and the spec quantizes activations (mxfp8 -> e4m3 x e2m1,
    mxfp4 -> e2m1 x e2m1), else upcast in registers (bf16 activations stay bf16 on every target)."""
    if expert_format != "mxfp4":
        return "none"
    if mx != "auto":
        return mx
    if not target.native_mxfp4 or activation_format not in ("mxfp8", "mxfp4"):
        return "upcast"
    return "e2m1" if activation_format == "mxfp4" else "e4m3"


@dataclass(frozen=True)
class MoEGemmPlan:
    block_m: int
    block_n: int
    block_k: int          # K elements per step (unpacked)
    num_warps: int
    num_stages: int
    joined: bool = False       # upcast: the MMA form, nibbles decoded, scaled and interleaved back into one
                               # [BLOCK_N, BLOCK_K] tile per step (False for float and native MX plans)
    gemv: int = 0              # upcast, BLOCK_M 16: FMA GEMV over the tile's real rows, this many rows at a time
    dequant: bool = False      # upcast: dequantize the experts to a bf16 workspace once, then the bf16 GEMM (tiles)
    pairs: bool = False        # upcast joined form, CUDA, bf16: E2M1 decoded straight to scaled bf16x2 K pairs (PTX)
    swap: bool = False         # joined: the weight tile is the MMA's A operand (acc [BLOCK_N, BLOCK_M], transposed)
    one_mul: bool = False      # pairs / lanes: one bf16x2 multiply per pair, exact for scales <= PAIRS1_MAX_SCALE (the
                               # runtime checks the weights' scales and else runs the two-multiply decode)
    lanes: bool = False        # upcast, sm_90: the weight tile is wgmma's register A operand, read from the payload in
                               # the load-time lanes layout (moe_lanes); acc [BLOCK_N, BLOCK_M]
    hopper: bool = False       # upcast, sm_90: the routed experts in the load-time hopper layout (moe_hopper), the
                               # weight tile wgmma's register A operand; acc [BLOCK_N, BLOCK_M]

    @property
    def tag(self) -> str:
        """Short name of the variant (bench tables)."""
        form = ("dequant" if self.dequant else f"gemv{self.gemv}" if self.gemv else
                "hopper" + ("1" if self.one_mul else "") if self.hopper else
                "lanes" + ("1" if self.one_mul else "") if self.lanes else
                ("pairs" + ("1" if self.one_mul else "") if self.pairs else "joined") + ("T" if self.swap else "")
                if self.joined else "mma")
        return f"{form}_m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"


# Default-plan rules of the upcast (sm_90 / gfx942) grouped GEMM, by expected rows per expert; the bench's --sweep
# times the alternatives, so switching the default to the measured best is a change of one of these lines
# (measurements: docs/perf.md, "MoE plan measurements").
DEQUANT_MIN_ROWS = 256      # prefill: dequantize once to bf16 and run the bf16 grouped GEMM from this many rows up
GEMV_MAX_ROWS = 1           # decode: the FMA GEMV form up to this many rows (from 2 rows the MMA form is faster)
PAIRS_MAX_ROWS = 16         # CUDA, bf16 activations: the joined form with the pair decode (E2M1 -> scaled bf16x2 in
                            # PTX, one multiply where the scales allow) up to this many rows per expert, in place of
                            # gemv / the fp16 decode (fewer instructions per weight in the K loop)
DEQUANT_WORKSPACE_BYTES = 2 << 30   # the bf16 workspace of one call (experts are processed in chunks that fit)


def _divisor_block(k: int, want: int, floor: int) -> int:
    """The largest power of two <= want that divides k (at least `floor`); 0 if none does."""
    b = want
    while b >= floor:
        if k % b == 0:
            return b
        b //= 2
    return 0


def _dequant_plan(kind: str, n: int, k: int, rows: int, dtype: str, target: Target, *, block_n: int | None,
                  block_k: int | None, num_warps: int | None, num_stages: int | None) -> MoEGemmPlan:
    """The dequant form: the bf16 grouped GEMM's plan over the dequantized workspace. 128 x 256 bf16 tiles (gate/up
    2 x 128) where 2 stages of them (96 KiB) fit, spill-free on sm_90."""
    wide = None if block_n or target.backend == "cpu" or target.shared_mem_bytes < 128 * 1024 else \
        min(256 // (2 if kind == "gate_up" else 1), max(16, pow2_ceil(n)))
    base = moe_gemm_plan(kind, n, k, rows, "none", dtype, target, block_n=block_n or wide, block_k=block_k,
                         num_warps=num_warps, num_stages=num_stages)
    return MoEGemmPlan(base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages, dequant=True)


def _hopper_plan(kind: str, n: int, k: int, rows: int, dtype: str, target: Target, *, block_n: int | None,
                 block_k: int | None, num_warps: int | None, num_stages: int | None,
                 one_mul: bool | None) -> MoEGemmPlan:
    """The Hopper form's one plan over rows per expert (moe_hopper; the weights' layout, chosen by the target at
    weight preparation, leaves no other form): BLOCK_M = the rows' bucket (16..128; gate_up at most 64), 128-K
    steps, 4 warps at 16-row tiles, 8 (two warpgroups over the weight rows) above, 128 weight rows per operand for
    gate_up (gate + up: 256 rows, as matmul_ogs' w13 tile; 256 at 64 rows per expert) and 256 for down, stages to
    fill shared memory (at most 4)."""
    if dtype not in ("bf16", "fp32"):
        raise CodegenError(f"the hopper form takes bf16 (or fp32: the portable decode, fp32 dots) activations, got "
                           f"{dtype}")
    if n % HOPPER_ROWS or k % HOPPER_K:
        raise CodegenError(f"the hopper layout needs N a multiple of {HOPPER_ROWS} and K of {HOPPER_K}; got N {n}, "
                           f"K {k}")
    bm = row_bucket(rows)
    n_b = 2 if kind == "gate_up" else 1
    if n_b == 2 and bm >= 64 and dtype == "bf16":
        # gate_up from 64 rows per expert: 64-row tiles, 2 x 256 weight rows at 64 rows per expert, 2 x 128 above
        # (a 128-row tile splits its 8 warps 4 x 2 over 2 x 64 weight rows, decoding each weight twice). H100,
        # bench/moe.py --sweep, E=128: 512 tokens 2063 us against 2529 (m64 n128), 4096 tokens 13207 against
        # 15343 (m128 n64); docs/perf.md issue 54
        bn_default = 256 if bm == 64 else 128
        bm = 64
    else:
        # gate_up at 128 rows: 64 per weight (2 x [64, 128] fp32 accumulators; at 128 the tile spills on sm_90)
        bn_default = 256 // n_b // (2 if n_b == 2 and bm >= 128 else 1)
    bn = block_n or min(bn_default, max(HOPPER_ROWS, pow2_ceil(n)))
    bk = _divisor_block(k, block_k or 128, HOPPER_K)
    if dtype == "fp32" and target.backend != "cpu":     # fp32 runs (checks, not speed): FMA dots, small tiles
        bn, bk = block_n or min(bn, 16 if n_b == 2 else 32), _divisor_block(k, block_k or HOPPER_K, HOPPER_K)
        bm, num_warps, num_stages = 16, num_warps or 4, num_stages or 2     # (larger: the gate_up tile spills)
    if bn % HOPPER_ROWS or not bk:
        raise CodegenError(f"hopper tiles: BLOCK_N a multiple of {HOPPER_ROWS}, BLOCK_K of {HOPPER_K} dividing K "
                           f"{k}; got {bn} x {block_k}")
    # 16-row tiles: 4 warps (one warpgroup over 128 / 256 weight rows: 1.09-1.40x over 8 warps on the H200,
    # docs/perf.md issue 54); from 32 rows 8 (at 4 the 32-row gate_up tile spills on sm_90)
    warps = num_warps or (4 if bm <= 16 else 8)
    if target.shared_mem_bytes <= 0:
        stages = 1
    else:
        stage = bm * bk * ELEM_BYTES[dtype] + n_b * bn * (bk // 2 + bk // 32)
        budget = target.shared_mem_bytes - target.shared_mem_bytes // 8
        stages = num_stages or max(2, min(4, budget // max(1, stage)))
    return MoEGemmPlan(bm, bn, bk, warps, stages, hopper=True, one_mul=one_mul if one_mul is not None else True)


def _lanes_plan(kind: str, n: int, k: int, rows: int, dtype: str, target: Target, *, block_n: int | None,
                block_k: int | None, num_warps: int | None, num_stages: int | None,
                one_mul: bool | None) -> MoEGemmPlan:
    """The lanes form (moe_lanes): BLOCK_N weight rows x BLOCK_M tokens per program, wgmma M = 64 weight rows per
    warpgroup (4 warps per 64 rows of BLOCK_N), 128-K groups. Decode (<= 32 rows): 64 x 256-K (two 128-K groups in
    flight per lane); prefill: 128-wide N tiles over 8 warps, 128-K steps."""
    if dtype != "bf16" or k % LANES_GROUP_K:
        raise CodegenError(f"the lanes form takes bf16 activations and K a multiple of {LANES_GROUP_K}, got "
                           f"{dtype}, K {k}")
    bm = row_bucket(rows)
    n_b = 2 if kind == "gate_up" else 1
    bn = block_n or (LANES_ROWS if bm <= 32 else 2 * LANES_ROWS)
    bk = _divisor_block(k, block_k or (256 if bm <= 32 else 128), LANES_GROUP_K)
    if bn % LANES_ROWS or not bk:
        raise CodegenError(f"lanes tiles: BLOCK_N a multiple of {LANES_ROWS}, BLOCK_K of {LANES_GROUP_K} dividing K "
                           f"{k}; got {bn} x {block_k}")
    warps = num_warps or 4 * (bn // LANES_ROWS)
    if target.shared_mem_bytes <= 0:
        stages = 1
    else:
        stage = bm * bk * ELEM_BYTES[dtype] + n_b * bn * (bk // 2 + bk // 32)
        budget = target.shared_mem_bytes - target.shared_mem_bytes // 8
        # decode tiles: 2 stages (1.04-1.09x over 4 on the H200: the smem of more stages costs resident warps)
        stages = num_stages or (2 if bm <= 32 else max(2, min(4, budget // max(1, stage))))
    return MoEGemmPlan(bm, bn, bk, warps, stages, lanes=True, one_mul=one_mul if one_mul is not None else True)


def moe_gemm_plan(kind: str, n: int, k: int, rows: int, mx: str, dtype: str, target: Target, *,
                  block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, gemv: int | None = None, dequant: bool | None = None,
                  pairs: bool | None = None, swap: bool | None = None, one_mul: bool | None = None,
                  lanes: bool | None = None, hopper: bool | None = None) -> MoEGemmPlan:
    """Tiles of the grouped expert GEMM. BLOCK_M = rows per expert rounded up to 16..128 (the tile-offset buckets).
    Decode (BLOCK_M 16-32; the weight stream dominates): narrow N tiles (32 columns, gate and up side by side for
    gate_up) so that the active experts' weights spread over many programs, long K steps (256) to keep bytes in
    flight. Prefill (64-128 rows; tensor cores): 128-wide N tiles (64 x 2 for gate_up), 64 K (bf16), 128 (native
    MX), 64 (upcast joined; 128 at 128 rows). MX weights need BLOCK_K | K (K is a multiple of 32); bf16 weights mask
    a ragged last K step. Stages fill the shared-memory budget (2-3; one on the interpreter, which also takes whole
    128-column N tiles: it pays per program). Upcast forms (module doc; None = the rules DEQUANT_MIN_ROWS /
    PAIRS_MAX_ROWS / GEMV_MAX_ROWS): pairs (CUDA, bf16: the joined form with the PTX pair decode, one_mul by
    default; swap puts the weights in the MMA's A operand), dequant (bf16 workspace + the bf16 tiles of this plan),
    gemv (FMA over the real rows of a 16-row tile), else the joined MMA form; lanes (sm_90 and the interpreter,
    bf16: the weights as wgmma's register A operand, payload in the lanes layout; _lanes_plan); hopper (weights in
    the load-time hopper layout: the only form that reads it; _hopper_plan). Overrides are for
    benchmarks."""
    up = mx == "upcast"
    if up and hopper:
        return _hopper_plan(kind, n, k, rows, dtype, target, block_n=block_n, block_k=block_k, num_warps=num_warps,
                            num_stages=num_stages, one_mul=one_mul)
    if up and lanes:
        return _lanes_plan(kind, n, k, rows, dtype, target, block_n=block_n, block_k=block_k, num_warps=num_warps,
                           num_stages=num_stages, one_mul=one_mul)
    if up and (dequant if dequant is not None else rows >= DEQUANT_MIN_ROWS):
        return _dequant_plan(kind, n, k, rows, dtype, target, block_n=block_n, block_k=block_k,
                             num_warps=num_warps, num_stages=num_stages)
    bm = row_bucket(rows)
    n_b = 2 if kind == "gate_up" else 1
    eb = ELEM_BYTES[dtype]
    # the pair decode (PTX, bf16 dots): by default at decode rows unless the GEMV form is asked for
    can_pair = up and target.backend == "cuda" and dtype == "bf16"
    use_pairs = can_pair and (pairs if pairs is not None else rows <= PAIRS_MAX_ROWS and not gemv)
    # GEMV rows per group: the expected rows (1, 2, 4), so a one-token expert does no masked FMAs
    use_gemv = (gemv if gemv is not None else min(4, pow2_ceil(rows)) if rows <= GEMV_MAX_ROWS else 0) \
        if up and not use_pairs else 0
    use_joined = up and not use_gemv
    if use_gemv:    # one 16-row tile; its real rows stream the weight tile once (FMA, no MMA layouts)
        bm, bn, bk = 16, (32 if use_gemv == 1 else 64) // n_b, 256   # 8 warps for 2-4 rows: 16-byte loads
    elif use_pairs and bm == 16:    # decode: 128-wide tiles halve the per-program overhead of the issue-bound loop;
        # 64 wide for the exact two-multiply decode, swap and the dense linears: at 128 they spill on sm_90
        # (tests/moe/test_moe_aot.py, test_mxfp4_linear_aot.py)
        wide = kind != "dense" and not swap and (one_mul if one_mul is not None else True)
        bn, bk = (128 if wide else 64) // n_b, 256
    elif bm <= 32:
        bn, bk = 64 // n_b, 256
    elif up:  # the joined form's prefill tiles: 128-K steps at 128 rows, 64 at 64
        bn, bk = 128 // n_b, 128 if bm >= 128 else 64
    else:
        bn, bk = 128 // n_b, 128 if mx != "none" else 128 // eb
    if target.backend == "cpu":     # the interpreter pays per program: whole rows of N in one tile
        bn = 128 // n_b
    bn = block_n or min(bn, max(16, pow2_ceil(n)))
    want_k = block_k or bk
    if mx != "none":
        if k % 32:
            raise CodegenError(f"MXFP4 weights need a reduction dim that is a multiple of 32, got {k}")
        bk = _divisor_block(k, max(32, want_k), 32)
    else:
        bk = max(16, min(want_k, pow2_ceil(k)))
    # 8 warps for the upcast prefill tiles: at 4 the accumulators and decoded tiles spilled
    warps = num_warps or (4 if bm * bn <= 64 * 64 and not (bm >= 64 and up) else 8)
    if use_gemv and not num_warps:  # 2-4 row groups: 8 warps (at 4 the per-row partial sums spilled on sm_90)
        warps = 4 if use_gemv == 1 else 8
    if use_pairs and bm == 16 and not num_warps:   # 4 warps (one warp: fewer instructions, too few bytes in flight)
        warps = 4
    if target.shared_mem_bytes <= 0:
        stages = 1
    elif num_stages:
        stages = num_stages
    else:
        w_bytes = bk // 2 + bk // 32 if mx != "none" else bk * eb
        stage = bm * bk * eb + n_b * bn * w_bytes
        budget = target.shared_mem_bytes - target.shared_mem_bytes // 8
        stages = max(2, min(3, budget // max(1, stage)))
    return MoEGemmPlan(bm, bn, bk, warps, stages, joined=use_joined, gemv=use_gemv, pairs=use_pairs,
                       swap=use_joined and bool(swap), one_mul=use_pairs and (one_mul if one_mul is not None else True))


# -- routing ------------------------------------------------------------------------------------------------------
ROUTER_ACTS = ("sigmoid", "softmax")


def _route_names(kind: str, e: int, k: int, e_local: int, e0: int) -> str:
    return ident(f"k3c_moe_{kind}_e{e}_k{k}" + (f"_l{e_local}_o{e0}" if e_local != e else ""))


def tokens_per_program(target: Target) -> int:
    """Tokens per routing / combine program: 4 on GPUs (a [4, E] score tile), 32 in the interpreter (which pays
    per program and per op, not per element)."""
    return 32 if target.backend == "cpu" else 4


def emit_moe_topk(num_experts: int, top_k: int, *, target: Target, router_activation: str = "sigmoid",
                  bias: bool = True, renormalize: bool = True, scaling: float = 1.0, e_local: int | None = None,
                  e0: int = 0, ir_op: str = "moe_route", loc: str = "") -> KernelSource:
    """Kernel args: logits_ptr f32 [N, E], (bias_ptr f32 [E]), w_ptr f32 [N, k], ids_ptr i32 [N, k],
    pres_ptr i32 [N, E_local], N; grid (cdiv(N, BLOCK_T),)."""
    E, K = check_dim(num_experts, "num_experts"), check_dim(top_k, "top_k")
    EL = check_dim(e_local or E, "local experts")
    if K > E or e0 < 0 or e0 + EL > E:
        raise CodegenError(f"bad routing shape: top_k {K}, experts {E}, local [{e0}, {e0 + EL})")
    if router_activation not in ROUTER_ACTS:
        raise CodegenError(f"router activation must be one of {ROUTER_ACTS}, got {router_activation!r}")
    kname = _route_names("topk", E, K, EL, e0) if router_activation == "sigmoid" else \
        ident(f"{_route_names('topk', E, K, EL, e0)}_softmax")
    kname = ident(kname + ("_bias" if bias else "") + ("" if renormalize else "_raw"))
    sig = {"logits_ptr": "*fp32"}
    if bias:
        sig["bias_ptr"] = "*fp32"
    sig.update({"w_ptr": "*fp32", "ids_ptr": "*i32", "pres_ptr": "*i32", "N": "i32"})
    cx = {"E": E, "E_PAD": pow2_ceil(E), "TOP_K": K, "K_PAD": pow2_ceil(K), "E0": e0, "E_LOCAL": EL,
          "BLOCK_T": tokens_per_program(target)}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"moe top-k: {router_activation} scores, bias={bias}, renormalize={renormalize}, "
                    f"scaling={scaling!r}, E={E} k={K} local=[{e0}, {e0 + EL})"])
    w.imports()
    with w.jit_function(kname, list(sig), list(cx)):
        w.lines([
            "t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)",
            "t_ok = t < N",
            "t64 = t.to(tl.int64)",
            "ex = tl.arange(0, E_PAD)",
            "e_ok = ex < E",
            "ok = t_ok[:, None] & e_ok[None, :]",
            "logit = tl.load(logits_ptr + t64[:, None] * E + ex[None, :], mask=ok, other=0.0)",
        ])
        if router_activation == "sigmoid":
            w.line("s = tl.where(ok, 1.0 / (1.0 + tl.exp(-logit)), 0.0)")
        else:
            w.lines(["lm = tl.where(ok, logit, float('-inf'))",
                     "p = tl.where(ok, tl.exp(lm - tl.max(lm, axis=1)[:, None]), 0.0)",
                     "s = p / tl.maximum(tl.sum(p, axis=1), 1e-30)[:, None]"])
        w.line("choice = s + tl.load(bias_ptr + ex, mask=e_ok, other=0.0)[None, :]" if bias else "choice = s")
        w.lines([
            "choice = tl.where(e_ok[None, :], choice, float('-inf'))",
            "kk = tl.arange(0, K_PAD)",
            "sel_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)",
            "sel_i = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)",
            "present = tl.zeros((BLOCK_T, E_PAD), dtype=tl.int32)",
            "for j in tl.static_range(TOP_K):",
            "    best = tl.max(choice, axis=1)",
            "    idx = tl.min(tl.where(choice == best[:, None], ex[None, :], E_PAD), axis=1)",
            "    hit = ex[None, :] == idx[:, None]",
            "    sj = tl.sum(tl.where(hit, s, 0.0), axis=1)",
            "    sel_w = tl.where(kk[None, :] == j, sj[:, None], sel_w)",
            "    sel_i = tl.where(kk[None, :] == j, idx[:, None], sel_i)",
            "    choice = tl.where(hit, float('-inf'), choice)",
            "    present = tl.where(hit, 1, present)",
        ])
        if renormalize:
            w.line("sel_w = sel_w / (tl.sum(sel_w, axis=1)[:, None] + 1e-20)")
        w.lines([
            f"sel_w = sel_w * {fnum(scaling)}",
            "k_ok = t_ok[:, None] & (kk < TOP_K)[None, :]",
            "tl.store(w_ptr + t64[:, None] * TOP_K + kk[None, :], sel_w, mask=k_ok)",
            "tl.store(ids_ptr + t64[:, None] * TOP_K + kk[None, :], sel_i, mask=k_ok)",
            "loc_ok = t_ok[:, None] & ((ex >= E0) & (ex < E0 + E_LOCAL))[None, :]",
            "tl.store(pres_ptr + t64[:, None] * E_LOCAL + (ex - E0)[None, :], present, mask=loc_ok)",
        ])
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx, grid=("cdiv(N, BLOCK_T)",),
                        num_warps=4 if E <= 1024 else 8, num_stages=1, ir_op=ir_op, loc=loc)


RANK_BLOCK_E, RANK_BLOCK_T = 32, 64


def emit_moe_rank(e_local: int, *, target: Target, ir_op: str = "moe_route", loc: str = "") -> KernelSource:
    """Kernel args: pres_ptr i32 [N, E_local] (presence in, exclusive rank out), cnt_ptr i32 [E_local], N;
    grid (cdiv(E_local, BLOCK_E),). Sequential over token blocks, parallel over experts."""
    EL = check_dim(e_local, "local experts")
    kname = ident(f"k3c_moe_rank_l{EL}")
    sig = {"pres_ptr": "*i32", "cnt_ptr": "*i32", "N": "i32"}
    cx = {"E_LOCAL": EL, "BLOCK_E": RANK_BLOCK_E, "BLOCK_T": RANK_BLOCK_T}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"moe rank: exclusive prefix count down the tokens, E_local={EL}"])
    w.imports()
    with w.jit_function(kname, list(sig), list(cx)):
        w.lines([
            "cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)",
            "c_ok = cols < E_LOCAL",
            "carry = tl.zeros((BLOCK_E,), dtype=tl.int32)",
            "for t0 in range(0, N, BLOCK_T):",
            "    rows = t0 + tl.arange(0, BLOCK_T)",
            "    ok = (rows < N)[:, None] & c_ok[None, :]",
            "    ptrs = pres_ptr + rows.to(tl.int64)[:, None] * E_LOCAL + cols[None, :]",
            "    p = tl.load(ptrs, mask=ok, other=0)",
            "    inc = tl.cumsum(p, axis=0)",
            "    tl.store(ptrs, inc - p + carry[None, :], mask=ok)",
            "    carry += tl.sum(p, axis=0)",
            "tl.store(cnt_ptr + cols, carry, mask=c_ok)",
        ])
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("cdiv(E_LOCAL, BLOCK_E)",), num_warps=4, num_stages=1, ir_op=ir_op, loc=loc)


def emit_moe_offsets(e_local: int, *, target: Target, ir_op: str = "moe_route", loc: str = "") -> KernelSource:
    """Kernel args: cnt_ptr i32 [E_local], off_ptr i32 [1 + len(ROW_BUCKETS), E_local + 1]; grid (1,). Row 0: the
    expert row offsets (exclusive scan of the counts); row 1 + b: the expert tile offsets for BLOCK_M =
    ROW_BUCKETS[b] (exclusive scan of cdiv(count, BLOCK_M)), so the grouped GEMMs find their tile's expert
    without a scan of their own."""
    EL = check_dim(e_local, "local experts")
    kname = ident(f"k3c_moe_offsets_l{EL}")
    sig = {"cnt_ptr": "*i32", "off_ptr": "*i32"}
    cx = {"E_LOCAL": EL, "E_PAD": pow2_ceil(EL + 1)}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"moe expert row and tile offsets (exclusive scans of the counts), E_local={EL}, "
                    f"BLOCK_M buckets {ROW_BUCKETS}"])
    w.imports()
    with w.jit_function(kname, list(sig), list(cx)):
        w.lines([
            "ex = tl.arange(0, E_PAD)",
            "cnt = tl.load(cnt_ptr + ex, mask=ex < E_LOCAL, other=0)",
            "tl.store(off_ptr + ex, tl.cumsum(cnt, axis=0) - cnt, mask=ex <= E_LOCAL)",
        ])
        for b, bm in enumerate(ROW_BUCKETS):
            w.line(f"tiles = (cnt + {bm - 1}) // {bm}")
            w.line(f"tl.store(off_ptr + {b + 1} * (E_LOCAL + 1) + ex, tl.cumsum(tiles, axis=0) - tiles,"
                   f" mask=ex <= E_LOCAL)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx, grid=("1",),
                        num_warps=4, num_stages=1, ir_op=ir_op, loc=loc)


def emit_moe_scatter(e_local: int, top_k: int, *, target: Target, e0: int = 0, ir_op: str = "moe_route",
                     loc: str = "") -> KernelSource:
    """Kernel args: ids_ptr i32 [N, k], rank_ptr i32 [N, E_local], off_ptr i32 [E_local + 1], perm_ptr i32
    [N * k], N; grid (cdiv(N, BLOCK_T),): perm[off[e] + rank(t, e)] = t * k + j for the local slots."""
    EL, K = check_dim(e_local, "local experts"), check_dim(top_k, "top_k")
    kname = ident(f"k3c_moe_scatter_l{EL}_k{K}" + (f"_o{e0}" if e0 else ""))
    sig = {"ids_ptr": "*i32", "rank_ptr": "*i32", "off_ptr": "*i32", "perm_ptr": "*i32", "N": "i32"}
    cx = {"E_LOCAL": EL, "TOP_K": K, "K_PAD": pow2_ceil(K), "E0": e0, "BLOCK_T": tokens_per_program(target)}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"moe scatter: stable slot permutation, E_local={EL} k={K} first={e0}"])
    w.imports()
    with w.jit_function(kname, list(sig), list(cx)):
        w.lines([
            "t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)",
            "kk = tl.arange(0, K_PAD)",
            "k_ok = (t < N)[:, None] & (kk < TOP_K)[None, :]",
            "slot = t[:, None] * TOP_K + kk[None, :]",
            "el = tl.load(ids_ptr + slot, mask=k_ok, other=-1) - E0",
            "local = k_ok & (el >= 0) & (el < E_LOCAL)",
            "el = tl.where(local, el, 0)",
            "base = tl.load(off_ptr + el, mask=local, other=0)",
            "rank = tl.load(rank_ptr + t.to(tl.int64)[:, None] * E_LOCAL + el, mask=local, other=0)",
            "tl.store(perm_ptr + base + rank, slot, mask=local)",
        ])
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx, grid=("cdiv(N, BLOCK_T)",),
                        num_warps=4, num_stages=1, ir_op=ir_op, loc=loc)


# -- grouped GEMM ---------------------------------------------------------------------------------------------------
# E2M1 nibbles -> fp16 holding value x 2^-14, exactly (code 1, 0.5 x 2^-14, is an fp16 subnormal, which the fp16
# MMAs keep): magnitude bits e1 e0 m go to fp16 bits 11..9 (exponent low bits + mantissa top bit), sign to bit 15.
# On CUDA one prmt spreads two bytes into the low bytes of two fp16 lanes, then two shift+and/or (lop3) pairs build a
# nibble per lane: 1.75 integer ops per element. Elsewhere the same bits in Triton integer ops (5 per element).
E2M1_FP16_ASM = (
    "{ .reg .b32 x, y, t, u; "
    "prmt.b32 x, $4, 0, 0x4140; prmt.b32 y, $4, 0, 0x4342; "
    "shl.b32 t, x, 9; and.b32 t, t, 0x0E000E00; shl.b32 u, x, 12; and.b32 u, u, 0x80008000; or.b32 $0, t, u; "
    "shl.b32 t, y, 9; and.b32 t, t, 0x0E000E00; shl.b32 u, y, 12; and.b32 u, u, 0x80008000; or.b32 $1, t, u; "
    "shl.b32 t, x, 5; and.b32 t, t, 0x0E000E00; shl.b32 u, x, 8; and.b32 u, u, 0x80008000; or.b32 $2, t, u; "
    "shl.b32 t, y, 5; and.b32 t, t, 0x0E000E00; shl.b32 u, y, 8; and.b32 u, u, 0x80008000; or.b32 $3, t, u; }")


# E2M1 pairs -> scaled bf16x2, for the joined MMA form on CUDA with bf16 activations ("pairs" plans). The packed
# tile is loaded as 32-bit words (8 weights, all in one 32-block); byte j of a word (K elements 2j, 2j+1 in its low /
# high nibble) becomes one bf16x2 register holding exactly the K pair an mma / wgmma B operand takes, so no
# interleave, fp32 round trip or cvt follows. Per byte: a prmt puts the low nibble at bits 12..15 and the high
# nibble at bits 28..31 (bytes of the word shifted left by 4, and of the word); the sign bits 15 / 31 stay, the
# magnitude bits (e1 e0 m) go down to bits 6..8 / 22..24: the bf16 pattern of value x 2^-126 (code 1, 0.5 x 2^-126,
# is a bf16 subnormal). One bf16x2 multiply by 2^126 makes it the exact E2M1 value, a second by the block's
# 2^(s - 127) (bf16 bits max(s << 7, 0x40) in both halves: s = 0 is the subnormal 2^-127) rounds once, as the
# reference's bf16 dequantization (E2M1 value in bf16 times the scale in bf16) does: 25 PTX ops per 8 weights plus
# 5 per word for the scale; the one-multiply variant (2^(s - 1), s <= 128) 21 + 1.
# Operands: $0..$3 the bf16x2 pairs of bytes 0..3 (int32), $4 the packed word, $5 its block's E8M0 scale (int32).
def _pairs_ops(one_mul: bool) -> list:
    """The op list of the pair decode: exact for every scale (two bf16x2 multiplies: 2^126, then 2^(s - 127)), or
    (one_mul) a single multiply by 2^(s - 1), exact for s <= PAIRS1_MAX_SCALE = 128 (|w| < 16): 2^(s - 1) overflows
    bf16 above that, so the runtime takes that variant only for weights whose scales fit."""
    ops = [("shl", "w4", "$4", 4)]
    if one_mul:     # bf16 bits of 2^(s - 1) = (s + 126) << 7 in both halves
        ops += [("mad", "m", "$5", 0x800080, 126 * 0x800080)]
    else:           # 2^(s - 127): s << 7, or the subnormal 0x0040 for s = 0
        ops += [("mov", "c", 0x7E807E80), ("mul", "m", "$5", 0x800080), ("mov", "lo", 0x00400040),
                ("max16", "m", "m", "lo")]
    for j in range(4):
        ops += [
            ("prmt", f"q{j}", "$4", "w4", j | (4 + j) << 4 | j << 8 | j << 12),   # byte1 <- w4.j, byte3 <- w.j
            ("shr", f"t{j}", f"q{j}", 6),
            ("and", f"t{j}", f"t{j}", 0x01C001C0),
            ("and", f"q{j}", f"q{j}", 0x80008000),
            ("or", f"q{j}", f"q{j}", f"t{j}"),
        ]
        ops += [("mulbf", f"${j}", f"q{j}", "m")] if one_mul else \
            [("mulbf", f"q{j}", f"q{j}", "c"), ("mulbf", f"${j}", f"q{j}", "m")]
    return ops


PAIRS1_MAX_SCALE = 128      # the one-multiply decode is exact for E8M0 scales up to this
E2M1_PAIRS_OPS = _pairs_ops(False)
E2M1_PAIRS1_OPS = _pairs_ops(True)


E2M1_PAIRS_ASM = ptx_text(E2M1_PAIRS_OPS)
E2M1_PAIRS1_ASM = ptx_text(E2M1_PAIRS1_OPS)


def e2m1_fp16_lines(p: str, lo: str, hi: str, asm: bool) -> list[str]:
    """Lines decoding the u8 tile `p` into fp16 tiles `lo` (low nibbles) and `hi` (high nibbles), value x 2^-14."""
    if asm:
        return [f"{lo}, {hi} = tl.inline_asm_elementwise(\"{E2M1_FP16_ASM}\", \"=r,=r,=r,=r,r\", [{p}],"
                f" dtype=(tl.float16, tl.float16), is_pure=True, pack=4)"]
    return [f"{p}_i = {p}.to(tl.int32)",
            f"{lo} = ((({p}_i & 7) << 9) | (({p}_i & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)",
            f"{hi} = ((({p}_i & 0x70) << 5) | (({p}_i & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)"]


def _emit_act_quant_helper(w: SourceWriter, fmt: str, bm: str, bk: str, interp: bool) -> None:
    """_k3c_quant_a(a fp32 [BM, BK]) -> (elements, scales u8 [BM, BK/32]) in the OCP floor rule."""
    emax, vmax = (8, 448.0) if fmt == "e4m3" else (2, 6.0)
    with w.jit_function("_k3c_quant_a", ["a", "BM", "BK"]):
        w.line("a3 = tl.reshape(a, (BM, BK // 32, 32))")
        w.line("amax = tl.max(tl.abs(a3), axis=2)")
        w.line(f"s = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 255) - {emax}, 0)")
        w.line("rcp = ((254 - tl.maximum(s, 1)) << 23).to(tl.float32, bitcast=True)  # 1 / max(2^(s-127), 2^-126)")
        w.line(f"q = tl.minimum(tl.maximum(a3 * rcp[:, :, None], {fnum(-vmax)}), {fnum(vmax)})")
        if fmt == "e4m3":
            if interp:      # the interpreter's fp8 cast truncates: round to nearest even first (then it is exact)
                w.line("b = q.to(tl.uint32, bitcast=True)")
                w.line("b = ((b + (((b >> 20) & 1) + 0x7FFFF)) >> 20) << 20")
                w.line("sub = (q + 24576.0) - 24576.0  # multiples of 2^-9 below 2^-6 (E4M3 subnormals)")
                w.line("q = tl.where(tl.abs(q) < 0.015625, sub, b.to(tl.float32, bitcast=True))")
            w.line("q = tl.reshape(q, (BM, BK)).to(tl.float8e4nv)")
        else:
            w.line("m = tl.abs(q)")
            w.line("code = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)"
                   " + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)"
                   " + (m > 5.0).to(tl.int32))")
            w.line("code = code | tl.where(q < 0, 8, 0)")
            w.line("pairs = tl.reshape(code, (BM, BK // 2, 2))")
            w.line("lo, hi = tl.split(pairs)")
            w.line("q = (lo | (hi << 4)).to(tl.uint8)")
        w.line("return q, s.to(tl.uint8)")


@dataclass(frozen=True)
class GroupedGemm:
    """One emit_moe_gemm kernel, checked (GroupedGemm.checked): shapes, dtypes, weight format, and the form its plan
    takes on this target (the interpreter variant runs the portable decode where the plan asks for PTX)."""
    kind: str
    N: int
    K: int
    E: int
    TK: int
    dt: str                 # activations
    wdt: str                # weights ("u8": MXFP4 packed bytes, with u8 E8M0 scales)
    odt: str                # output
    mx: str
    plan: MoEGemmPlan
    target: Target
    interp: bool            # the interpreter variant
    glu: object             # gate_up: the GLU of the epilogue (GluAct); else None
    chunk: bool             # expert_chunk: only experts [E0, E1) run, over weight stacks holding just those
    gemv: int               # upcast GEMV form: rows per group; else 0
    joined: bool            # upcast joined MMA form
    pairs_asm: str | None   # joined form, CUDA, bf16, compiled: the PTX of the bf16x2 pair decode; else None
    swap: bool              # joined / lanes: the weight tile is the MMA's A operand (acc [BLOCK_N, BLOCK_M])
    lanes: bool             # upcast lanes form (payload in the lanes layout)
    lanes_asm: str | None   # lanes form, CUDA, compiled: the PTX of the perm pair decode; else None (portable)
    use_asm: bool           # upcast, CUDA, compiled: the prmt decode of the nibbles (else Triton integer ops)
    hopper: bool = False    # upcast hopper form (routed experts in the hopper layout)
    hopper_asm: str | None = None   # hopper form, CUDA, compiled: the PTX of its decode; else None (portable)

    @classmethod
    def checked(cls, kind: str, n: int, k: int, *, target: Target, plan: MoEGemmPlan, num_experts: int = 1,
                top_k: int = 1, mx: str = "none", dtype: str = "bf16", w_dtype: str | None = None,
                out_dtype: str | None = None, act: object = "swiglu", interpret: bool | None = None,
                expert_chunk: bool = False) -> "GroupedGemm":
        if kind not in KINDS:
            raise CodegenError(f"moe gemm kind must be one of {KINDS}, got {kind!r}")
        if mx not in MX_MODES:
            raise CodegenError(f"mx mode must be one of {MX_MODES}, got {mx!r}")
        N, K = check_dim(n, "N"), check_dim(k, "K")
        E, TK = check_dim(num_experts, "num_experts"), check_dim(top_k, "top_k")
        dt = check_float(dtype)
        wdt = "u8" if mx != "none" else check_float(w_dtype or dt, "w_dtype")
        odt = check_float(out_dtype or dt, "out_dtype")
        interp = interpreted(target, interpret)
        if mx in ("e4m3", "e2m1") and dt == "fp32":
            raise CodegenError("native MX GEMMs take bf16/fp16 activations")
        if kind != "dense" and plan.block_m not in ROW_BUCKETS:
            raise CodegenError(f"grouped GEMM BLOCK_M must be one of {ROW_BUCKETS} (the routing's tile offsets)")
        if mx != "none" and (K % plan.block_k or plan.block_k % 32):
            raise CodegenError(f"MXFP4 GEMM: BLOCK_K {plan.block_k} must be a multiple of 32 dividing K {K}")
        if plan.dequant and mx != "none":
            raise CodegenError("a dequant plan runs the bf16 kernel (mx 'none') on the dequantized workspace")
        gemv = plan.gemv if plan.gemv and mx == "upcast" else 0
        joined = plan.joined and mx == "upcast" and not gemv
        # the bf16x2 pair decode: PTX, bf16 dots (elsewhere the same plan runs the portable decode, same numerics)
        pairs = joined and plan.pairs and target.backend == "cuda" and not interp and dt == "bf16"
        if gemv and plan.block_m != 16:
            raise CodegenError("the GEMV form takes 16-row tiles")
        lanes = plan.lanes and mx == "upcast"
        if lanes and (dt != "bf16" or K % plan.block_k or plan.block_k % LANES_GROUP_K
                      or (target.backend == "cuda" and plan.block_n % LANES_ROWS)):
            raise CodegenError(f"lanes form: bf16 activations, BLOCK_K a multiple of {LANES_GROUP_K} dividing K, "
                               f"BLOCK_N of {LANES_ROWS}; got {dt}, {plan.block_k} / {K}, {plan.block_n}")
        if lanes and target.backend == "hip":
            raise CodegenError("the lanes form is wgmma's (sm_90); hip targets run the joined or dequant forms")
        hopper = plan.hopper and mx == "upcast"
        if hopper and (kind == "dense" or dt not in ("bf16", "fp32") or N % HOPPER_ROWS or K % HOPPER_K
                       or plan.block_k % HOPPER_K or K % plan.block_k or plan.block_n % HOPPER_ROWS):
            raise CodegenError(f"hopper form: routed experts, bf16 / fp32 activations, N a multiple of {HOPPER_ROWS}, "
                               f"K and BLOCK_K of {HOPPER_K} (BLOCK_K dividing K), BLOCK_N of {HOPPER_ROWS}; got {kind}, "
                               f"{dt}, N {N}, K {K}, tiles {plan.block_n} x {plan.block_k}")
        if hopper and target.backend == "hip":
            raise CodegenError("the hopper layout is sm_90's; hip targets keep their native-MX / upcast layouts")
        return cls(kind, N, K, E, TK, dt, wdt, odt, mx, plan, target, interp,
                   glu=glu_act(act) if kind == "gate_up" else None, chunk=expert_chunk and kind != "dense",
                   gemv=gemv, joined=joined,
                   pairs_asm=(E2M1_PAIRS1_ASM if plan.one_mul else E2M1_PAIRS_ASM) if pairs else None,
                   # (also in the interpreter, with the portable decode: the same epilogue runs)
                   swap=(joined and plan.swap) or lanes or hopper, lanes=lanes,
                   lanes_asm=(E2M1_PAIRS1_PERM_ASM if plan.one_mul else E2M1_PAIRS_PERM_ASM)
                   if lanes and target.backend == "cuda" and not interp else None,
                   use_asm=mx == "upcast" and target.backend == "cuda" and not interp, hopper=hopper,
                   hopper_asm=(HOPPER_DECODE_ASM if plan.one_mul else HOPPER_DECODE_EXACT_ASM)
                   if hopper and target.backend == "cuda" and not interp and dt == "bf16" else None)

    @property
    def routed(self) -> bool:
        return self.kind != "dense"

    @property
    def native(self) -> bool:
        return self.mx in ("e4m3", "e2m1")

    @property
    def pairs(self) -> bool:
        return self.pairs_asm is not None

    @property
    def wn(self) -> tuple[str, ...]:
        """The weight operands' names: gate and up for gate_up, else one."""
        return ("wg", "wu") if self.glu is not None else ("w",)

    @property
    def op_dt(self) -> str:
        """Dot operands: bf16 on GPUs; the interpreter multiplies bf16 tiles as raw bits, so it gets fp32 copies."""
        return "tl.float32" if (self.interp or self.dt == "fp32") else TL_DTYPE[self.dt]

    @property
    def dot_kw(self) -> str:
        return ', input_precision="ieee"' if (self.interp or self.dt == "fp32") else ""


def emit_moe_gemm(kind: str, n: int, k: int, *, target: Target, plan: MoEGemmPlan, num_experts: int = 1,
                  top_k: int = 1, mx: str = "none", dtype: str = "bf16", w_dtype: str | None = None,
                  out_dtype: str | None = None, act: object = "swiglu", name: str | None = None,
                  ir_op: str = "moe_experts", loc: str = "", interpret: bool | None = None,
                  expert_chunk: bool = False) -> KernelSource:
    """Grouped (gate_up, down) or dense MXFP4/bf16 GEMM; see the module doc.

    Kernel args (W = w1/w3 or w2 stacks [E, N, K]; mx: packed [E, N, K/2] + scale [E, N, K/32] pairs):
        gate_up: a_ptr [T, K], wg(, wgs), wu(, wus), off_ptr i32 [E + 1], perm_ptr i32 [S], c_ptr [S, N], TILES
        down:    a_ptr [S, K] (permuted), w(, ws), off_ptr, perm_ptr, c_ptr [S, N] (slot order), TILES
        dense:   a_ptr [M, K], w(, ws), c_ptr [M, N], M
    grid: routed (TILES, cdiv(N, BLOCK_N)) with TILES an upper bound of the M tiles (tile_slots()); dense
    (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). expert_chunk (routed): two more args E0, E1; only the tiles of experts
    [E0, E1) run and the weight stacks hold just those experts (the dequant path's bf16 workspace)."""
    g = GroupedGemm.checked(kind, n, k, target=target, plan=plan, num_experts=num_experts, top_k=top_k, mx=mx,
                            dtype=dtype, w_dtype=w_dtype, out_dtype=out_dtype, act=act, interpret=interpret,
                            expert_chunk=expert_chunk)
    operand = None if g.gemv else operand_form(g)
    kname = ident(name if name is not None else gemm_kernel_name(g))
    w = SourceWriter()
    emit_gemm_preamble(w, g, kname, ir_op, loc, gemm_form_words(g))
    sig, cx = gemm_kernel_args(g)
    with w.jit_function(kname, list(sig), list(cx)):
        emit_tile_rows(w, g)
        if g.gemv:
            _emit_gemv_body(w, g)
        else:
            emit_mma_mainloop(w, g, *operand)
            emit_mma_epilogue(w, g)
    return gemm_kernel_source(g, kname, w, sig, cx, ir_op, loc)


# -- the parts emit_moe_gemm composes ---------------------------------------------------------------------------
def gemm_kernel_name(g: GroupedGemm) -> str:
    """The descriptive kernel name: kind, activation, shapes, dtype, BLOCK_M (the hopper form: and its weight rows
    per operand, which differ between plans of one BLOCK_M), weight format and form."""
    tags = ["k3c_moe", g.kind, f"n{g.N}", f"k{g.K}", name_part(g.dt),
            f"m{g.plan.block_m}" + (f"r{g.plan.block_n}" if g.hopper else "")]
    if g.routed:
        tags.insert(3, f"e{g.E}")
    if g.mx != "none":
        tags.append(f"mx{g.mx}")
    if g.lanes:
        tags.append("ln" + ("1" if g.plan.one_mul else ""))
    if g.hopper:
        tags.append("hp" + ("1" if g.plan.one_mul else ""))
    if g.gemv or g.joined:
        tags.append(f"gv{g.gemv}" if g.gemv else ("jp" + ("1" if g.plan.one_mul else "") if g.pairs else "j")
                    + ("t" if g.swap else ""))
    if g.chunk:
        tags.append("ch")
    if g.glu is not None:
        tags.insert(2, name_part(g.glu.tag()))
    return "_".join(tags)


def gemm_form_words(g: GroupedGemm) -> str:
    """The form's words in the header note."""
    return ((" gemv" if g.gemv else "") + (" joined" if g.joined else "") + (" pairs" if g.pairs else "")
            + (" lanes" if g.lanes else "") + (" hopper" if g.hopper else "")
            + (" expert_chunk" if g.chunk else ""))


def gemm_kernel_args(g: GroupedGemm) -> tuple[dict[str, str], dict[str, int]]:
    """(signature, constexprs) of the kernel (emit_moe_gemm's doc lists the args)."""
    sig: dict[str, str] = {"a_ptr": f"*{g.dt}"}
    for x in g.wn:
        sig[f"{x}_ptr"] = f"*{g.wdt}"
        if g.mx != "none":
            sig[f"{x}s_ptr"] = "*u8"
    if g.routed:
        sig.update({"off_ptr": "*i32", "perm_ptr": "*i32"})
    sig.update({"c_ptr": f"*{g.odt}", "TILES" if g.routed else "M": "i32"})
    if g.chunk:
        sig.update({"E0": "i32", "E1": "i32"})
    p = g.plan
    cx = {"N": g.N, "K": g.K, "BLOCK_M": p.block_m, "BLOCK_N": p.block_n, "BLOCK_K": p.block_k}
    if g.routed:
        cx.update({"E": g.E, "E_PAD": pow2_ceil(g.E), "TOP_K": g.TK})
    return sig, cx


def emit_gemm_preamble(w: SourceWriter, g: GroupedGemm, kname: str, ir_op: str, loc: str, forms: str) -> None:
    """The header (notes: shapes, dtypes, tiles and the form words `forms`), the imports and the helpers (math of
    the output cast and the GLU; the activation quantizer of the native MX forms)."""
    glu, p = g.glu, g.plan
    what = f"{g.kind}" + (f" {glu.kind}" + (f" beta_gate={glu.beta_gate!r} beta_up={glu.beta_up!r}"
                                            if glu.kind == "situ" else "") if glu is not None else "")
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=g.target, emitter=__name__,
             notes=[f"moe gemm {what} N={g.N} K={g.K} E={g.E} top_k={g.TK} a:{g.dt} w:{g.wdt} mx={g.mx} out:{g.odt}",
                    f"tiles {p.block_m}x{p.block_n}x{p.block_k} num_warps={p.num_warps} num_stages={p.num_stages}"
                    + forms + (" [interpreter variant]" if g.interp else "")])
    w.imports()
    emit_math_helpers(w, **(glu_helpers(glu) if glu is not None else {}), rtne_bf16=g.interp and g.odt == "bf16")
    if g.native:
        _emit_act_quant_helper(w, g.mx, "BLOCK_M", "BLOCK_K", g.interp)


def emit_tile_rows(w: SourceWriter, g: GroupedGemm) -> None:
    """The program's tile. Routed: its expert (from the routing's tile offsets for BLOCK_M; programs past the last
    tile exit), rows offs_m / m_ok of the permuted order and A's rows rows_a (gathered through perm for gate_up),
    e64 the expert's weight stack. Dense: plain row tiles. Then the N tile (offs_n, n_ok, the weight rows rows_w)."""
    if g.routed:
        w.line(f"t_off = off_ptr + {ROW_BUCKETS.index(g.plan.block_m) + 1} * (E + 1)  # tile offsets for this BLOCK_M")
        w.lines([
            "tile = tl.program_id(0) + tl.load(t_off + E0)",
            "pid_n = tl.program_id(1)",
            "if tile >= tl.load(t_off + E1):",
            "    return",
        ] if g.chunk else [
            "tile = tl.program_id(0)",
            "pid_n = tl.program_id(1)",
            "if tile >= tl.load(t_off + E):",
            "    return",
        ])
        w.lines([
            "ex = tl.arange(0, E_PAD)",
            "e_ok = ex < E",
            "ends = tl.load(t_off + ex + 1, mask=e_ok, other=2147483647)",
            "e = tl.sum((ends <= tile).to(tl.int32), axis=0)",
            "row0 = tl.load(off_ptr + e) + (tile - tl.load(t_off + e)) * BLOCK_M",
            "row_end = tl.load(off_ptr + e + 1)",
            "offs_m = row0 + tl.arange(0, BLOCK_M)",
            "m_ok = offs_m < row_end",
            "e64 = (e - E0).to(tl.int64)  # the workspace holds experts E0.. only" if g.chunk else
            "e64 = e.to(tl.int64)",
        ])
        if g.kind == "gate_up":
            w.line("slot = tl.load(perm_ptr + offs_m, mask=m_ok, other=0)")
            w.line("rows_a = (slot // TOP_K).to(tl.int64)")
        else:
            w.line("rows_a = tl.where(m_ok, offs_m, row0).to(tl.int64)")
    else:
        w.lines([
            "pid_m = tl.program_id(0)",
            "pid_n = tl.program_id(1)",
            "offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
            "m_ok = offs_m < M",
            "rows_a = (offs_m % M).to(tl.int64)",
            "e64 = 0",
        ])
    w.line("offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
    w.line("n_ok = offs_n < N")
    w.line("rows_w = (offs_n % N).to(tl.int64)" if g.N % g.plan.block_n else "rows_w = offs_n.to(tl.int64)")


def emit_mma_mainloop(w: SourceWriter, g: GroupedGemm, pointers, step) -> None:
    """The MMA forms' K loop: the operand pointers (`pointers(w, g)`), one fp32 accumulator per weight, then
    `step(w, g)` once per BLOCK_K (it loads, decodes, multiplies and advances the pointers)."""
    pointers(w, g)
    for x in g.wn:
        # swap: the weight tile is the MMA's A operand (its decoded registers feed the MMA in place), the
        # accumulator [BLOCK_N, BLOCK_M] is transposed back after the loop
        w.line(f"acc_{x} = tl.zeros(({'BLOCK_N, BLOCK_M' if g.swap else 'BLOCK_M, BLOCK_N'}), dtype=tl.float32)")
    w.line(f"for kb in range(0, {num(-(-g.K // g.plan.block_k))}):")
    with w.indent():
        step(w, g)


def emit_mma_epilogue(w: SourceWriter, g: GroupedGemm) -> None:
    """The MMA forms' epilogue: the GLU of gate_up's two accumulators (else the one), stored in the output dtype
    (down: rows scattered back to slot order through perm; else in place)."""
    for x in (g.wn if g.swap else ()):
        w.line(f"acc_{x} = tl.trans(acc_{x})")
    w.line("c_mask = m_ok[:, None] & n_ok[None, :]")
    if g.kind == "down":
        w.line("rows_c = tl.load(perm_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)")
    else:
        w.line("rows_c = offs_m.to(tl.int64)")
    w.line("c_offs = rows_c[:, None] * N + offs_n[None, :]")
    if g.glu is not None:
        w.lines(glu_lines(g.glu, "acc_wg", "acc_wu", "acc"))
    else:
        w.line("acc = acc_w")
    w.line(f"tl.store(c_ptr + c_offs, {to_dtype('acc', g.odt, g.interp)}, mask=c_mask)")


def gemm_kernel_source(g: GroupedGemm, kname: str, w: SourceWriter, sig: dict, cx: dict, ir_op: str,
                       loc: str) -> KernelSource:
    grid = ("TILES", "cdiv(N, BLOCK_N)") if g.routed else ("cdiv(M, BLOCK_M)", "cdiv(N, BLOCK_N)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx, grid=grid,
                        num_warps=g.plan.num_warps, num_stages=g.plan.num_stages, ir_op=ir_op, loc=loc)


# -- the B operand per weight format: (pointers, K step) of emit_mma_mainloop -------------------------------------
def operand_form(g: GroupedGemm):
    """(pointers, K step) of the B operand for the kernel's weight format, for emit_mma_mainloop."""
    if g.joined:
        return _joined_pointers, _joined_step
    if g.lanes:
        return lanes_pointers, lanes_step
    if g.hopper:
        return hopper_pointers, hopper_step
    if g.native:
        return _native_pointers, _native_step
    if g.mx == "none":
        return _float_pointers, _float_step
    raise CodegenError("an upcast GEMM plan takes the gemv, joined or dequant form (moe_gemm_plan)")


def _float_pointers(w: SourceWriter, g: GroupedGemm) -> None:
    w.line("offs_k = tl.arange(0, BLOCK_K)")
    w.line("a_ptrs = a_ptr + rows_a[:, None] * K + offs_k[None, :]")
    for x in g.wn:
        w.line(f"{x}_ptrs = {x}_ptr + e64 * (N * K) + rows_w[None, :] * K + offs_k[:, None]")


def _float_step(w: SourceWriter, g: GroupedGemm) -> None:
    """bf16 / fp32 weights: tl.dot (a ragged last K step masked)."""
    even_k = g.K % g.plan.block_k == 0
    if even_k:
        w.line("a = tl.load(a_ptrs)")
    else:
        w.line("k_ok = offs_k < K - kb * BLOCK_K")
        w.line("a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)")
    for x in g.wn:
        if even_k:
            w.line(f"{x} = tl.load({x}_ptrs)")
        else:
            w.line(f"{x} = tl.load({x}_ptrs, mask=k_ok[:, None], other=0.0)")
        if g.wdt != g.dt:   # as the reference's linear: W cast to A's dtype (rounded), then the product
            w.line(f"{x} = " + (to_dtype(f"{x}.to(tl.float32)", g.dt, g.interp) if g.dt != "fp32"
                                else f"{x}.to(tl.float32)"))
        w.line(f"acc_{x} = tl.dot(a.to({g.op_dt}), {x}.to({g.op_dt}), acc_{x}{g.dot_kw})")
    w.line("a_ptrs += BLOCK_K")
    for x in g.wn:
        w.line(f"{x}_ptrs += BLOCK_K")


def _native_pointers(w: SourceWriter, g: GroupedGemm) -> None:
    w.line("offs_k = tl.arange(0, BLOCK_K)")
    w.line("offs_h = tl.arange(0, BLOCK_K // 2)")
    w.line("offs_s = tl.arange(0, BLOCK_K // 32)")
    w.line("a_ptrs = a_ptr + rows_a[:, None] * K + offs_k[None, :]")
    for x in g.wn:
        w.line(f"{x}_ptrs = {x}_ptr + e64 * (N * (K // 2)) + rows_w[None, :] * (K // 2) + offs_h[:, None]")
        w.line(f"{x}s_ptrs = {x}s_ptr + e64 * (N * (K // 32)) + rows_w[:, None] * (K // 32) + offs_s[None, :]")


def _native_step(w: SourceWriter, g: GroupedGemm) -> None:
    """MX matrix units: A quantized per 32 in registers, tl.dot_scaled with the packed weights and their scales."""
    w.line("aq, a_s = _k3c_quant_a(tl.load(a_ptrs).to(tl.float32), BLOCK_M, BLOCK_K)")
    for x in g.wn:
        w.line(f"acc_{x} = tl.dot_scaled(aq, a_s, \"{g.mx}\", tl.load({x}_ptrs), tl.load({x}s_ptrs), \"e2m1\","
               f" acc_{x})")
    w.line("a_ptrs += BLOCK_K")
    _emit_wtile_advance(w, g.wn)


def _joined_pointers(w: SourceWriter, g: GroupedGemm) -> None:
    w.line("offs_k = tl.arange(0, BLOCK_K)")
    w.line("a_ptrs = a_ptr + rows_a[:, None] * K + offs_k[None, :]")
    _emit_wtile_ptrs(w, g.wn)
    if g.pairs:   # the packed tile as 32-bit words (K / 2 is a multiple of 16 bytes: aligned rows)
        w.line("offs_q = tl.arange(0, BLOCK_K // 8)")
        for x in g.wn:
            w.line(f"{x}_wptrs = {x}_ptr.to(tl.pointer_type(tl.int32)) + e64 * (N * (K // 8))"
                   f" + rows_w[:, None] * (K // 8) + offs_q[None, :]")


def _joined_step(w: SourceWriter, g: GroupedGemm) -> None:
    """Upcast MMA: the nibbles decoded and scaled per 32-block, interleaved back into K order (the pair decode
    yields them in K order), one dot per step."""
    w.line(f"a = tl.load(a_ptrs).to({g.op_dt})")
    for x in g.wn:
        if g.pairs:
            _emit_wtile_pairs(w, x, f"wv_{x}", g.pairs_asm)
        else:
            _emit_wtile_decode(w, x, f"wv_{x}", g.use_asm, g.op_dt)
        w.line(f"acc_{x} = tl.dot(wv_{x}, tl.trans(a), acc_{x}{g.dot_kw})" if g.swap else
               f"acc_{x} = tl.dot(a, tl.trans(wv_{x}), acc_{x}{g.dot_kw})")
    w.line("a_ptrs += BLOCK_K")
    _emit_wtile_advance(w, g.wn)
    for x in (g.wn if g.pairs else ()):
        w.line(f"{x}_wptrs += BLOCK_K // 8")


def _emit_wtile_ptrs(w: SourceWriter, wn) -> None:
    """Pointers of the [BLOCK_N, BLOCK_K / 2] packed tile (K contiguous: 16-byte loads) and its scales."""
    w.line("offs_h = tl.arange(0, BLOCK_K // 2)")
    w.line("offs_s = tl.arange(0, BLOCK_K // 32)")
    for x in wn:
        w.line(f"{x}_ptrs = {x}_ptr + e64 * (N * (K // 2)) + rows_w[:, None] * (K // 2) + offs_h[None, :]")
        w.line(f"{x}s_ptrs = {x}s_ptr + e64 * (N * (K // 32)) + rows_w[:, None] * (K // 32) + offs_s[None, :]")


def _emit_wtile_advance(w: SourceWriter, wn) -> None:
    for x in wn:
        w.line(f"{x}_ptrs += BLOCK_K // 2")
        w.line(f"{x}s_ptrs += BLOCK_K // 32")


def _emit_wtile_decode(w: SourceWriter, x: str, out: str, use_asm: bool, out_dt: str) -> None:
    """`out` [BLOCK_N, BLOCK_K] = the weight tile: E2M1 values (fp16 x 2^-14) times 2^(s - 113) in fp32 (exact),
    in `out_dt`, low / high nibbles joined back into K order (element 2i is the low nibble)."""
    w.lines(e2m1_fp16_lines(f"tl.load({x}_ptrs)", "w_lo", "w_hi", True) if use_asm else
            [f"p = tl.load({x}_ptrs)"] + e2m1_fp16_lines("p", "w_lo", "w_hi", False))
    w.line(f"sc = (((tl.load({x}s_ptrs).to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True))[:, :, None]")
    w.line("w_lo = tl.reshape(w_lo.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 16)) * sc")
    w.line("w_hi = tl.reshape(w_hi.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 16)) * sc")
    w.line(f"{out} = tl.reshape(tl.join(w_lo.to({out_dt}), w_hi.to({out_dt})), (BLOCK_N, BLOCK_K))")


def _emit_wtile_pairs(w: SourceWriter, x: str, out: str, asm: str) -> None:
    """`out` bf16 [BLOCK_N, BLOCK_K] = the weight tile decoded by the pair decode `asm` (E2M1_PAIRS(1)_ASM) from
    32-bit words of the packed tile: each byte -> one bf16x2 (its K pair), the block scale applied in bf16 (exact;
    see E2M1_PAIRS_OPS)."""
    w.line(f"s_{x} = tl.reshape(tl.broadcast_to(tl.load({x}s_ptrs).to(tl.int32)[:, :, None],"
           f" (BLOCK_N, BLOCK_K // 32, 4)), (BLOCK_N, BLOCK_K // 8))")
    w.line(f"o0, o1, o2, o3 = tl.inline_asm_elementwise(\"{asm}\", \"=r,=r,=r,=r,r,r\","
           f" [tl.load({x}_wptrs), s_{x}], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)")
    w.line(f"v_{x} = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (BLOCK_N, BLOCK_K // 2))  # byte order")
    w.line(f"{out} = tl.reshape(tl.join(v_{x}.to(tl.int16).to(tl.bfloat16, bitcast=True),"
           f" (v_{x} >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)), (BLOCK_N, BLOCK_K))")


# -- the GEMV form (upcast, decode rows) ----------------------------------------------------------------------------
def _emit_gemv_body(w: SourceWriter, g: GroupedGemm) -> None:
    """The GEMV form of a 16-row tile: its real rows, g.gemv at a time, each group streaming the weight tile once;
    the decoded values meet each row's even / odd activations in fp32 FMAs, summed per 32-block and then scaled
    (no per-element scale multiply, no nibble interleave, no MMA operand layout: ~3.75 ops per weight and row
    group on CUDA; at 1-4 rows the FMAs cost less than the decode)."""
    group, wn = g.gemv, g.wn
    if g.kind == "dense":
        w.line("row0 = pid_m * BLOCK_M")
        w.line("r_end = tl.minimum(M, row0 + BLOCK_M)")
    else:
        w.line("r_end = tl.minimum(row_end, row0 + BLOCK_M)")
    w.line("offs_k = tl.arange(0, BLOCK_K)")
    w.line(f"for r0 in range(row0, r_end, {group}):")
    with w.indent():
        for r in range(group):
            w.line(f"r{r} = r0 + {r}")
            w.line(f"ok{r} = r{r} < r_end")
            if g.kind == "gate_up":
                w.line(f"ar{r} = (tl.load(perm_ptr + r{r}, mask=ok{r}, other=0) // TOP_K).to(tl.int64) * K")
            else:
                w.line(f"ar{r} = tl.where(ok{r}, r{r}, row0).to(tl.int64) * K")
            for x in wn:
                w.line(f"acc{r}_{x} = tl.zeros((BLOCK_N,), dtype=tl.float32)")
        _emit_wtile_ptrs(w, wn)
        # the next K step's packed tile and scales are loaded before this step's decode (register double buffer:
        # these loads feed no dot, so the pipeliner leaves them alone); the last step reloads its own tile
        for x in wn:
            w.line(f"p_{x} = tl.load({x}_ptrs)")
            w.line(f"s_{x} = tl.load({x}s_ptrs)")
        w.line("for kb in range(0, K // BLOCK_K):")
        with w.indent():
            w.line("nxt = 1 - (kb + 1) // (K // BLOCK_K)  # 0 on the last step")
            for x in wn:
                w.line(f"p_{x}_n = tl.load({x}_ptrs + nxt * (BLOCK_K // 2))")
                w.line(f"s_{x}_n = tl.load({x}s_ptrs + nxt * (BLOCK_K // 32))")
            for x in wn:    # unscaled values (x 2^-14) in fp32; the scale multiplies each 32-block's partial sum
                w.lines(e2m1_fp16_lines(f"p_{x}", "w_lo", "w_hi", g.use_asm))
                w.line(f"lo_{x} = tl.reshape(w_lo.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 16))")
                w.line(f"hi_{x} = tl.reshape(w_hi.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 16))")
                w.line(f"sc_{x} = ((s_{x}.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)")
                w.line(f"p_{x} = p_{x}_n")
                w.line(f"s_{x} = s_{x}_n")
            for r in range(group):
                w.line(f"a_e, a_o = tl.split(tl.reshape(tl.load(a_ptr + ar{r} + kb * BLOCK_K + offs_k)"
                       f".to(tl.float32), (BLOCK_K // 32, 16, 2)))")
                for x in wn:
                    w.line(f"part = tl.sum(lo_{x} * a_e[None, :, :] + hi_{x} * a_o[None, :, :], axis=2)")
                    w.line(f"acc{r}_{x} += tl.sum(part * sc_{x}, axis=1)")
            _emit_wtile_advance(w, wn)
        _emit_gemv_store(w, g)


def _emit_gemv_store(w: SourceWriter, g: GroupedGemm) -> None:
    """Each row group's epilogue: the GLU of its gate / up sums (else the sum), stored row by row (down: scattered
    back to slot order through perm)."""
    for r in range(g.gemv):
        if g.glu is not None:
            w.lines(glu_lines(g.glu, f"acc{r}_wg", f"acc{r}_wu", f"out{r}"))
        else:
            w.line(f"out{r} = acc{r}_w")
        if g.kind == "down":
            w.line(f"rc{r} = tl.load(perm_ptr + r{r}, mask=ok{r}, other=0).to(tl.int64)")
        else:
            w.line(f"rc{r} = r{r}.to(tl.int64)")
        w.line(f"tl.store(c_ptr + rc{r} * N + offs_n, {to_dtype(f'out{r}', g.odt, g.interp)},"
               f" mask=n_ok & (offs_n * 0 + r{r} < r_end))")


DEQUANT_BLOCKS = 256    # 32-element blocks per dequant program: 4 KiB of packed bytes in, 16 KiB of bf16 out


def emit_moe_dequant(n: int, k: int, *, target: Target, dtype: str = "bf16", ir_op: str = "moe_experts",
                     loc: str = "", interpret: bool | None = None) -> KernelSource:
    """The dequant path's first half: experts [E0, E1) of an MXFP4 stack (packed u8 [E, N, K/2] + E8M0 u8
    [E, N, K/32]) to `dtype` [E1 - E0, N, K] (exact: E2M1 x 2^s has 2 significant bits). A stream: 16 packed bytes
    and one scale per 32 outputs, the same register decode as the GEMMs; experts without rows (off row 0) exit.
    Kernel args: p_ptr, s_ptr, off_ptr i32, out_ptr, E0, E1; grid (E1 - E0, cdiv(N * K / 32, BLOCK_B))."""
    N, K = check_dim(n, "N"), check_dim(k, "K")
    if K % 32:
        raise CodegenError(f"MXFP4 weights need a reduction dim that is a multiple of 32, got {K}")
    dt = check_float(dtype)
    interp = interpreted(target, interpret)
    use_asm = target.backend == "cuda" and not interp
    kname = ident(f"k3c_moe_dequant_n{N}_k{K}_{name_part(dt)}")
    sig = {"p_ptr": "*u8", "s_ptr": "*u8", "off_ptr": "*i32", "out_ptr": f"*{dt}", "E0": "i32", "E1": "i32"}
    cx = {"N": N, "K": K, "BLOCK_B": DEQUANT_BLOCKS}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"moe MXFP4 expert dequant N={N} K={K} -> {dt}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    with w.jit_function(kname, list(sig), list(cx)):
        w.lines([
            "e = E0 + tl.program_id(0)",
            "if tl.load(off_ptr + e + 1) == tl.load(off_ptr + e):",
            "    return",
            "e64 = e.to(tl.int64)",
            "blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)  # 32-blocks, row-major over [N, K / 32]",
            "ok = blk < N * (K // 32)",
            "p = tl.load(p_ptr + e64 * (N * (K // 2)) + blk[:, None] * 16 + tl.arange(0, 16)[None, :],"
            " mask=ok[:, None], other=0)",
        ])
        w.lines(e2m1_fp16_lines("p", "w_lo", "w_hi", use_asm))
        w.lines([
            "sc = (((tl.load(s_ptr + e64 * (N * (K // 32)) + blk, mask=ok, other=0).to(tl.int32) + 14) << 23)"
            ".to(tl.float32, bitcast=True))[:, None]",
            f"v = tl.reshape(tl.join((w_lo.to(tl.float32) * sc).to({TL_DTYPE[dt]}),"
            f" (w_hi.to(tl.float32) * sc).to({TL_DTYPE[dt]})), (BLOCK_B, 32))",
            "dst = out_ptr + (e - E0).to(tl.int64) * (N * K) + blk[:, None] * 32 + tl.arange(0, 32)[None, :]",
            "tl.store(dst, v, mask=ok[:, None])",
        ])
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("E1 - E0", "cdiv(N * (K // 32), BLOCK_B)"), num_warps=4, num_stages=1, ir_op=ir_op,
                        loc=loc)


def tile_slots(slots: int, num_experts: int, block_m: int) -> int:
    """Grid rows of a grouped GEMM over `slots` permuted rows: an upper bound of its M tiles."""
    return min(-(-slots // block_m) + num_experts, slots)


def emit_moe_linear(n: int, k: int, *, target: Target, m_hint: int, dtype: str = "bf16", w_dtype: str | None = None,
                    out_dtype: str | None = None, residual: bool = False, interpret: bool | None = None
                    ) -> KernelSource:
    """The dense GEMMs of a MoE layer (router logits in fp32, latent down, latent up + residual): the generic GEMM
    template (k3c.codegen.kernels.gemm) under its own name, so it never collides with another op's GEMM of the same
    shape in an artifact. Kernel args: a_ptr, w_ptr, (res_ptr), c_ptr, M."""
    from .gemm import emit_gemm

    odt = out_dtype or dtype
    name = "_".join(["k3c_moe_linear", f"n{check_dim(n, 'N')}", f"k{check_dim(k, 'K')}", name_part(dtype),
                     f"m{int(m_hint)}"] + ([f"out_{name_part(odt)}"] if odt != dtype else [])
                    + (["res"] if residual else []))
    return emit_gemm(n, k, target=target, m_hint=m_hint, dtype=dtype, w_dtype=w_dtype, out_dtype=odt,
                     residual=residual, name=ident(name), ir_op="moe_linear", interpret=interpret)


# -- combine ----------------------------------------------------------------------------------------------------------
def emit_moe_combine(z: int, top_k: int, *, target: Target, dtype: str = "bf16", out_dtype: str | None = None,
                     residual: bool = False, e_local: int | None = None, e0: int = 0, ir_op: str = "moe_combine",
                     loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Kernel args: y_ptr [N * k, Z] (slot order), w_ptr f32 [N, k], (ids_ptr i32 [N, k] with expert
    parallelism), (res_ptr [N, Z]), out_ptr [N, Z], N; grid (cdiv(N, BLOCK_T), cdiv(Z, BLOCK_Z)). e_local: this
    rank's experts [e0, e0 + e_local) when the experts are split (None: all local, no id check)."""
    Z, K = check_dim(z, "Z"), check_dim(top_k, "top_k")
    dt = check_float(dtype)
    odt = check_float(out_dtype or dt, "out_dtype")
    interp = interpreted(target, interpret)
    ep = e_local is not None
    bt = 1 if target.backend != "cpu" else tokens_per_program(target)
    block = min(pow2_ceil(Z), 1024 if bt == 1 else 128)
    kname = ident(f"k3c_moe_combine_z{Z}_k{K}_{name_part(dt)}" + ("_res" if residual else "")
                  + (f"_ep{e_local}_{e0}" if ep else ""))
    sig = {"y_ptr": f"*{dt}", "w_ptr": "*fp32"}
    if ep:
        sig["ids_ptr"] = "*i32"
    if residual:
        sig["res_ptr"] = f"*{odt}"
    sig.update({"out_ptr": f"*{odt}", "N": "i32"})
    cx = {"Z": Z, "TOP_K": K, "BLOCK_Z": block, "BLOCK_T": bt}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"moe combine Z={Z} k={K} y:{dt} out:{odt} residual={residual} local="
                    + (f"[{e0}, {e0 + e_local})" if ep else "all") + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and odt == "bf16")
    with w.jit_function(kname, list(sig), list(cx)):
        w.lines([
            "t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)",
            "t_ok = t < N",
            "cols = tl.program_id(1) * BLOCK_Z + tl.arange(0, BLOCK_Z)",
            "ok = t_ok[:, None] & (cols < Z)[None, :]",
            "acc = tl.zeros((BLOCK_T, BLOCK_Z), dtype=tl.float32)",
            "for j in tl.static_range(TOP_K):",
            "    p = tl.load(w_ptr + t * TOP_K + j, mask=t_ok, other=0.0)",
        ])
        with w.indent():
            if ep:
                w.line("e = tl.load(ids_ptr + t * TOP_K + j, mask=t_ok, other=-1)")
                w.line(f"use = ok & ((e >= {num(e0)}) & (e < {num(e0 + e_local)}))[:, None]")
            else:
                w.line("use = ok")
            w.line("y = tl.load(y_ptr + (t * TOP_K + j)[:, None] * Z + cols[None, :], mask=use, other=0.0)")
            w.line("acc += y.to(tl.float32) * p[:, None]")
        w.line("offs = t[:, None] * Z + cols[None, :]")
        if residual:
            w.line("acc += tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32)")
        w.line(f"tl.store(out_ptr + offs, {to_dtype('acc', odt, interp)}, mask=ok)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("cdiv(N, BLOCK_T)", "cdiv(Z, BLOCK_Z)"), num_warps=4, num_stages=1, ir_op=ir_op,
                        loc=loc)


__all__ = ["expert_plan", "expert_gemm_kernels", "expert_gemm_classes", "EXPERT_ROW_CLASSES",
           "emit_moe_topk", "emit_moe_rank", "emit_moe_offsets", "emit_moe_scatter", "tokens_per_program",
           "emit_moe_gemm", "GroupedGemm", "emit_moe_dequant", "DEQUANT_MIN_ROWS", "GEMV_MAX_ROWS", "PAIRS_MAX_ROWS",
           "PAIRS1_MAX_SCALE", "DEQUANT_WORKSPACE_BYTES", "emit_moe_combine", "emit_moe_linear", "moe_gemm_plan",
           "MoEGemmPlan", "tile_slots", "mx_mode", "row_bucket", "MX_MODES", "ROW_BUCKETS"]


# -- the one choice of the expert GEMM kernels (runtime and AOT) ----------------------------------------------------
def expert_plan(kind: str, n: int, k: int, rows: int, *, target: Target, mx: str, dtype: str,
                one_mul_fits: bool = True, plan: MoEGemmPlan | None = None, hopper: bool = False) -> MoEGemmPlan:
    """The plan for `rows` rows per expert (the dense kind: rows = tokens, already a token bucket when `plan` is
    the dense rule's). `one_mul_fits` is the data-dependent answer of the weights' scale check
    (runtime.kernel_impls.moe.scales_fit_one_mul); False takes the exact two-multiply pair decode, planned as such
    (narrower tiles: the 128-wide exact decode spills on sm_90). An explicit `plan` (the dense linears' rule,
    benchmarks) gets its exact twin by flipping the flag. `hopper`: the weights are in the hopper layout
    (weight_layout), so the hopper form's plan."""
    if plan is None:
        hp = hopper or None     # weights in the hopper layout (routed experts, sm_90 targets): its form only
        plan = moe_gemm_plan(kind, n, k, rows, mx, dtype, target, hopper=hp)
        if plan.one_mul and not one_mul_fits:
            plan = moe_gemm_plan(kind, n, k, rows, mx, dtype, target, one_mul=False, hopper=hp)
    elif plan.one_mul and not one_mul_fits:
        plan = dataclasses.replace(plan, one_mul=False)
    return plan


def expert_gemm_kernels(kind: str, n: int, k: int, *, plan: MoEGemmPlan, target: Target, mx: str, dtype: str,
                        w_dtype: str | None, out_dtype: str, act: object = None, num_experts: int = 1,
                        top_k: int = 1, ir_op: str = "", loc: str = "",
                        interpret: bool | None = None) -> tuple[KernelSource, KernelSource | None]:
    """The GEMM kernel of `plan` (expert_plan), and the dequant kernel where the plan first expands MXFP4 weights
    to a bf16 workspace (else None). The runtime calls this with the plan of the shapes at hand;
    `expert_gemm_classes` with every plan, so the artifact holds whatever the runtime can pick."""
    if plan.dequant and mx == "upcast":     # the bf16 kernel over the dequantized workspace, by expert chunks
        gemm = emit_moe_gemm(kind, n, k, target=target, plan=plan, num_experts=num_experts, top_k=top_k, mx="none",
                             dtype=dtype, w_dtype=dtype, out_dtype=out_dtype, act=act, ir_op=ir_op, loc=loc,
                             interpret=interpret, expert_chunk=kind != "dense")
        return gemm, emit_moe_dequant(n, k, target=target, dtype=dtype, ir_op=ir_op, loc=loc, interpret=interpret)
    gemm = emit_moe_gemm(kind, n, k, target=target, plan=plan, num_experts=num_experts, top_k=top_k, mx=mx,
                         dtype=dtype, w_dtype=None if mx != "none" else w_dtype, out_dtype=out_dtype, act=act,
                         ir_op=ir_op, loc=loc, interpret=interpret)
    return gemm, None


# rows per expert that reach every branch of moe_gemm_plan: each value up to past the largest threshold (gemv,
# pairs, row buckets, dequant), then powers of two (nothing changes above DEQUANT_MIN_ROWS but the count)
EXPERT_ROW_CLASSES = tuple(range(1, 2 * max(DEQUANT_MIN_ROWS, ROW_BUCKETS[-1]) + 1)) + tuple(
    2 ** i for i in range(10, 21))


def expert_gemm_classes(kind: str, n: int, k: int, *, target: Target, mx: str, dtype: str,
                        rows=EXPERT_ROW_CLASSES, plan_for=None, hopper: bool = False, **kw) -> list[KernelSource]:
    """Every kernel the runtime can launch for these weights: expert_plan over `rows`, with both answers of the
    scale check, through expert_gemm_kernels (distinct plans only). plan_for(rows) gives the explicit plan a caller
    passes (the dense linears' token-bucket rule)."""
    plans: dict = {}
    for r in rows:
        for fits in (True, False):
            p = expert_plan(kind, n, k, r, target=target, mx=mx, dtype=dtype, one_mul_fits=fits,
                            plan=plan_for(r) if plan_for else None, hopper=hopper)
            plans.setdefault(p, r)
    out: dict[str, KernelSource] = {}
    for p in plans:
        for ks in expert_gemm_kernels(kind, n, k, plan=p, target=target, mx=mx, dtype=dtype, **kw):
            if ks is not None:
                out.setdefault(ks.key, ks)
    return list(out.values())

