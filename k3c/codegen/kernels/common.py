"""Shared pieces of the kernel emitters: dtypes, activations, portable math helpers and block-size rules.

Block sizes come from the Target's properties (warp size, shared-memory budget) through the functions here, never
from its name. A target with `shared_mem_bytes == 0` (the `cpu` target: the Triton interpreter) has no shared
memory to pipeline through, so it gets one stage and no budget limit; its warp size of 1 only feeds the formulas.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..targets import Target
from ..writer import CodegenError, SourceWriter, fnum

# -- dtypes ------------------------------------------------------------------------------------------------------
FLOAT_DTYPES = ("fp32", "bf16", "fp16")
TL_DTYPE = {"fp32": "tl.float32", "bf16": "tl.bfloat16", "fp16": "tl.float16", "i64": "tl.int64",
            "i32": "tl.int32"}
ELEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "i64": 8, "i32": 4}
IR_DTYPES = {"bf16": "bf16", "f32": "fp32", "f16": "fp16"}     # IR tensor dtype -> the kernels' dtype name


def check_float(dtype: str, what: str = "dtype") -> str:
    if dtype not in FLOAT_DTYPES:
        raise CodegenError(f"{what} must be one of {FLOAT_DTYPES}, got {dtype!r}")
    return dtype


def check_dim(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value >= 2 ** 31:
        raise CodegenError(f"{what} must be a positive int below 2**31, got {value!r}")
    return value


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


# -- activations -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GluAct:
    """A gated activation act(g, u): `swiglu` = silu(g) u; `situ` = [bg tanh(g/bg) sigmoid(g)] [bu tanh(u/bu)]."""
    kind: str = "swiglu"
    beta_gate: float = 4.0
    beta_up: float = 25.0

    def tag(self) -> str:
        return self.kind


def glu_act(act: object) -> GluAct:
    """Normalise a GLU activation: a GluAct, 'swiglu' / 'situ', or anything shaped like the frontend's
    ActivationSpec (kind, situ_beta_gate, situ_beta_up)."""
    if isinstance(act, GluAct):
        out = act
    elif isinstance(act, str):
        out = GluAct(act)
    elif hasattr(act, "kind"):
        out = GluAct(str(act.kind), float(getattr(act, "situ_beta_gate", 4.0)),
                     float(getattr(act, "situ_beta_up", 25.0)))
    else:
        raise CodegenError(f"unknown GLU activation {act!r}")
    if out.kind not in ("swiglu", "situ"):
        raise CodegenError(f"unknown GLU activation kind {out.kind!r} (swiglu | situ)")
    if out.kind == "situ":
        for b in (out.beta_gate, out.beta_up):
            if not (isinstance(b, (int, float)) and math.isfinite(b) and b > 0):
                raise CodegenError(f"SiTU betas must be finite and positive, got {b!r}")
    return out


@dataclass(frozen=True)
class EpiAct:
    """A pointwise activation for a GEMM epilogue: none | silu | sigmoid | relu | situ_gate (b tanh(x/b) sigmoid(x))
    | situ_up (b tanh(x/b))."""
    kind: str = "none"
    beta: float = 0.0

    def tag(self) -> str:
        return self.kind


EPI_KINDS = ("none", "silu", "sigmoid", "relu", "situ_gate", "situ_up")


def epi_act(act: object) -> EpiAct:
    """Normalise: None, 'silu', ('situ_gate', 4.0), EpiAct(...)."""
    if act is None:
        out = EpiAct()
    elif isinstance(act, EpiAct):
        out = act
    elif isinstance(act, str):
        out = EpiAct(act, 4.0 if act == "situ_gate" else 25.0 if act == "situ_up" else 0.0)
    elif isinstance(act, tuple) and len(act) == 2 and isinstance(act[0], str):
        out = EpiAct(act[0], float(act[1]))
    else:
        raise CodegenError(f"unknown epilogue activation {act!r}")
    if out.kind not in EPI_KINDS:
        raise CodegenError(f"unknown epilogue activation {out.kind!r} ({' | '.join(EPI_KINDS)})")
    if out.kind.startswith("situ") and not (math.isfinite(out.beta) and out.beta > 0):
        raise CodegenError(f"SiTU beta must be finite and positive, got {out.beta!r}")
    return out


# -- portable math helpers (emitted as @triton.jit functions into the generated module) --------------------------
# Only tl.exp / arithmetic / tl.where: no tl.extra.libdevice (it differs between CUDA and HIP), no tl.tanh (absent).
TANH_SMALL = 0.125      # below this |x|, an odd Taylor polynomial (error < 1e-9 relative) replaces 1 - 2/(e^2x + 1)
TANH_CLAMP = 15.0       # tanh(15) == 1 in fp32; clamping keeps exp finite


def emit_math_helpers(w: SourceWriter, *, sigmoid: bool = False, tanh: bool = False, rtne_bf16: bool = False,
                      rtne_e4m3: bool = False) -> None:
    if rtne_e4m3:
        with w.jit_function("_k3c_rtne_e4m3", ["x"]):
            w.line("# x (|x| <= 448) rounded to nearest even e4m3 in fp32, then cast exactly: the interpreter's own cast")
            w.line("# loses the exponent carry (127.8 -> 64). Normals keep 3 mantissa bits; below 2^-6 the step is 2^-9")
            w.line("b = x.to(tl.uint32, bitcast=True)")
            w.line("b = b + (((b >> 20) & 1) + 0x7FFFF)")
            w.line("n = ((b >> 20) << 20).to(tl.float32, bitcast=True)")
            w.line("s = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0   # 1.5 * 2^23: RNE to 2^-9 steps")
            w.line("return tl.where(tl.abs(x) < 0.015625, s, n).to(tl.float8e4nv)")
    if rtne_bf16:
        with w.jit_function("_k3c_rtne_bf16", ["x"]):
            w.line("# fp32 -> bf16 rounding to nearest even in integer ops (the interpreter's cast truncates)")
            w.line("b = x.to(tl.uint32, bitcast=True)")
            w.line("b = b + (((b >> 16) & 1) + 0x7FFF)")
            w.line("y = ((b >> 16) << 16).to(tl.float32, bitcast=True)")
            w.line("return tl.where(x != x, x, y).to(tl.bfloat16)")
    if sigmoid:
        with w.jit_function("_k3c_sigmoid", ["x"]):
            w.line("# 1 / (1 + e^-x): exp(-x) -> inf gives 0, exp(-x) -> 0 gives 1; no NaN for finite x")
            w.line("return 1.0 / (1.0 + tl.exp(-x))")
    if tanh:
        with w.jit_function("_k3c_tanh", ["x"]):
            w.line("# tanh(x) = 1 - 2 / (exp(2x) + 1) on the clamped input; odd Taylor series near 0 (no cancellation)")
            w.line(f"xc = tl.minimum(tl.maximum(x, {fnum(-TANH_CLAMP)}), {fnum(TANH_CLAMP)})")
            w.line("big = 1.0 - 2.0 / (tl.exp(2.0 * xc) + 1.0)")
            w.line("x2 = x * x")
            w.line(f"small = x * (1.0 + x2 * ({fnum(-1 / 3)} + x2 * ({fnum(2 / 15)} + x2 * {fnum(-17 / 315)})))")
            w.line(f"return tl.where(tl.abs(x) < {fnum(TANH_SMALL)}, small, big)")


def glu_helpers(act: GluAct) -> dict[str, bool]:
    return {"sigmoid": act.kind == "swiglu", "tanh": False}


def _tanh_parts(x: str, t: str) -> list[str]:
    """Lines defining {t}_n / {t}_d = tanh(x) as a numerator/denominator pair (no division yet)."""
    c = fnum(TANH_CLAMP)
    return [f"{t}_e = tl.exp(2.0 * tl.minimum(tl.maximum({x}, -{c}), {c}))",
            f"{t}_s = tl.abs({x}) < {fnum(TANH_SMALL)}",
            f"{t}_x2 = {x} * {x}",
            f"{t}_p = {x} * (1.0 + {t}_x2 * ({fnum(-1 / 3)} + {t}_x2 * ({fnum(2 / 15)} + {t}_x2 * {fnum(-17 / 315)})))",
            f"{t}_n = tl.where({t}_s, {t}_p, {t}_e - 1.0)",
            f"{t}_d = tl.where({t}_s, 1.0, {t}_e + 1.0)"]


def glu_lines(act: GluAct, g: str, u: str, out: str) -> list[str]:
    """Lines computing `out = act(g, u)` on fp32 values (names must already be identifiers in the kernel).

    SiTU-GLU = bg bu tanh(g/bg) tanh(u/bu) sigmoid(g) is evaluated as one fraction, (bg bu n_g n_u) / (d_g d_u
    (1 + e^-g)) with tanh = n/d = (e^2t - 1)/(e^2t + 1) (odd Taylor series for |t| < 1/8, where the exp form
    cancels): 3 exp and 1 division per element instead of 3 and 3 (the special-function unit bounds this kernel).
    The denominator overflows to inf only where sigmoid(g) < 1e-25, giving 0 for a value below 1e-23."""
    if act.kind == "swiglu":
        return [f"{out} = ({g} * _k3c_sigmoid({g})) * {u}"]
    bg, bu = float(act.beta_gate), float(act.beta_up)
    return [f"{out}_tg = {g} * {fnum(1.0 / bg)}", f"{out}_tu = {u} * {fnum(1.0 / bu)}",
            *_tanh_parts(f"{out}_tg", f"{out}_g"), *_tanh_parts(f"{out}_tu", f"{out}_u"),
            f"{out} = ({fnum(bg * bu)} * {out}_g_n * {out}_u_n) / "
            f"({out}_g_d * {out}_u_d * (1.0 + tl.exp(-{g})))"]


def epi_helpers(act: EpiAct) -> dict[str, bool]:
    return {"sigmoid": act.kind in ("silu", "sigmoid", "situ_gate"), "tanh": act.kind in ("situ_gate", "situ_up")}


def epi_lines(act: EpiAct, x: str) -> list[str]:
    """Lines applying the activation to the fp32 value `x` in place."""
    k = act.kind
    if k == "none":
        return []
    if k == "silu":
        return [f"{x} = {x} * _k3c_sigmoid({x})"]
    if k == "sigmoid":
        return [f"{x} = _k3c_sigmoid({x})"]
    if k == "relu":
        return [f"{x} = tl.maximum({x}, 0.0)"]
    b = fnum(act.beta)
    if k == "situ_gate":
        return [f"{x} = {b} * _k3c_tanh({x} / {b}) * _k3c_sigmoid({x})"]
    return [f"{x} = {b} * _k3c_tanh({x} / {b})"]


def interpreted(target: Target, interpret: bool | None) -> bool:
    """Whether to emit the interpreter variant: asked for explicitly, else when the target is the interpreter
    (backend 'cpu'). It differs only where Triton's interpreter (3.9) departs from the GPUs:
    - bf16 tl.dot operands are multiplied as their raw uint16 bits -> the tiles are upcast to fp32 first (exact:
      bf16 products are exact in fp32, so this equals a bf16 tensor-core dot with fp32 accumulation);
    - fp32 -> bf16 casts truncate -> rounded to nearest even in integer ops first (`to_dtype`), as GPUs round."""
    return target.backend == "cpu" if interpret is None else bool(interpret)


def to_dtype(expr: str, dtype: str, interpret: bool) -> str:
    """Source casting the fp32 value `expr` to `dtype` with round-to-nearest-even on every backend (fp8e4nv: |expr|
    <= 448; the interpreter's forms need emit_math_helpers' rtne_bf16 / rtne_e4m3)."""
    if dtype == "bf16" and interpret:
        return f"_k3c_rtne_bf16({expr})"
    if dtype == "fp8e4nv":
        return f"_k3c_rtne_e4m3({expr})" if interpret else f"({expr}).to(tl.float8e4nv)"
    return f"({expr}).to({TL_DTYPE[dtype]})"


# -- block-size rules ------------------------------------------------------------------------------------------------
ROW_MAX_WARPS = 8           # warps per program for one row (norm, softmax)
ROW_ELEMS_PER_THREAD = 32   # fp32 values one thread holds for a row block before we loop over the row instead


def lanes(target: Target) -> int:
    """SIMT lanes per warp for the formulas: the target's warp size, at least 32 (the interpreter's warp size of 1
    would otherwise give tiny blocks: it runs a block as one numpy op, bigger is cheaper)."""
    return max(int(target.warp_size), 32)


def vec_elems(elem_bytes: int) -> int:
    """Elements per 16-byte vector access."""
    return max(1, 16 // elem_bytes)


@dataclass(frozen=True)
class RowPlan:
    block: int          # BLOCK_D (power of two)
    num_warps: int
    looped: bool        # the row is longer than one block: the kernel loops over it


def row_max_block(target: Target) -> int:
    return lanes(target) * ROW_MAX_WARPS * ROW_ELEMS_PER_THREAD


def row_plan(n_cols: int, elem_bytes: int, target: Target, max_block: int | None = None) -> RowPlan:
    """One row per program: the whole row in one block when it fits the register budget, else loop over it."""
    cap = row_max_block(target) if max_block is None else pow2_floor(max(16, max_block))
    full = pow2_ceil(n_cols)
    block = min(full, cap)
    threads = max(1, block // vec_elems(elem_bytes))
    warps = clamp(pow2_floor(max(1, threads // target.warp_size)), 1, ROW_MAX_WARPS)
    return RowPlan(block=block, num_warps=warps, looped=full > cap)


def elementwise_plan(n_cols: int, elem_bytes: int, target: Target) -> RowPlan:
    """2-D grid (row, column block) for bandwidth kernels (embedding gather, GLU): 4 warps of 16-byte vectors,
    twice over (each thread moves 32 bytes per tensor)."""
    cap = lanes(target) * 4 * vec_elems(elem_bytes) * 2
    block = min(pow2_ceil(n_cols), cap)
    threads = max(1, block // vec_elems(elem_bytes))
    warps = clamp(pow2_floor(max(1, threads // target.warp_size)), 1, 4)
    return RowPlan(block=block, num_warps=warps, looped=False)


@dataclass(frozen=True)
class GemmPlan:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    smem_bytes: int     # the pipeline's planned shared memory: stages x (BM + nB*BN) x BK x elem bytes


GEMM_MAX_STAGES = 4     # 3 for 128-row tiles
GEMM_MIN_PROGRAMS = 96  # about one program per SM / CU of current GPUs (Target has no SM count yet)
GEMM_SMEM_HEADROOM = 8  # keep 1/8 of the budget for the epilogue's layout conversion and the compiler's scratch


def gemm_plan(m_hint: int, n: int, k: int, elem_bytes: int, target: Target, n_b: int = 1) -> GemmPlan:
    """Tile sizes for C[M,N] = A[M,K] W[N,K]^T (n_b = 2 for the gate+up GLU kernel, which streams two W tiles).

    m_hint is the token-count bucket (launch.m_bucket: 16 .. 1024). BLOCK_M follows it (16 for decode, up to 128).
    Large M (> 256; compute bound): 128 x (256 / n_b) output tiles and 128-byte K slices (64 bf16). Mid M (65..256,
    plain GEMM): 64 x 128 x 64. Small M (weight streaming): BLOCK_N 64 and long K slices (512 bytes for BLOCK_M = 16,
    256 for 32 and 64) so each program keeps many bytes in flight. BLOCK_N then narrows while fewer than
    GEMM_MIN_PROGRAMS programs would run. Then the shared-memory budget: stages x (BM*BK + nB*BN*BK) x bytes <= 7/8
    target.shared_mem_bytes, stages in [2, 4] (at most 3 for 128-row tiles); when even 2 stages do not fit, BN
    shrinks (to 64), then BK (to 32), then BM (to 16). These tiles against cuBLAS: docs/perf.md, "Plan rules"."""
    bm = clamp(pow2_ceil(max(1, m_hint)), 16, 128)
    if bm >= 128 and n_b == 1 and m_hint <= 256:
        bm, bn, bk = 64, 128, 128 // elem_bytes          # mid M: twice the programs of 128-row tiles
    elif bm >= 128:
        bn, bk = 256 // n_b, 128 // elem_bytes
    else:
        # 32 x 32 x 256 bf16 spilled on sm_90, and so did the two-accumulator GLU at 32 x 64 x 128
        bn, bk = 64, (512 if bm <= 16 else 256 // n_b) // elem_bytes
    bn = min(bn, max(16, pow2_ceil(n)))
    bk = clamp(min(bk, pow2_ceil(k)), 16, 256)
    # enough programs to cover the machine: narrow the N tiles (down to 128 / nB columns for 128-row tiles, 32 / nB
    # for weight streaming) while fewer than GEMM_MIN_PROGRAMS would run
    bn_floor = max(16, (128 if bm >= 128 else 32) // n_b)
    while bn > bn_floor and -(-max(1, m_hint) // bm) * -(-n // bn) < GEMM_MIN_PROGRAMS:
        bn //= 2
    # 128-row tiles and the two-accumulator GLU kernel keep one stage less (the GLU at 32 x 64 x 128 x 4 stages
    # spilled on sm_90)
    max_stages = GEMM_MAX_STAGES if bm <= 64 and n_b == 1 else GEMM_MAX_STAGES - 1
    if target.shared_mem_bytes <= 0:
        stages = 1
        need = 0
    else:
        budget = target.shared_mem_bytes - target.shared_mem_bytes // GEMM_SMEM_HEADROOM
        while True:
            stage = (bm + n_b * bn) * bk * elem_bytes
            stages = min(max_stages, budget // stage)
            if stages >= 2:
                break
            if bn > 64:
                bn //= 2
            elif bk > 32:
                bk //= 2
            elif bm > 16:
                bm //= 2
            elif bn > 16:
                bn //= 2
            elif bk > 16:
                bk //= 2
            else:
                raise CodegenError(f"target {target.name}: {target.shared_mem_bytes} B of shared memory cannot hold"
                                   f" even a 16x16x16 two-stage GEMM pipeline")
        need = stages * (bm + n_b * bn) * bk * elem_bytes
    acc_elems_per_thread = 64 // n_b                 # fp32 accumulator registers per thread (x n_b accumulators)
    warps = clamp(pow2_floor(max(1, bm * bn // acc_elems_per_thread // target.warp_size)), 4, 8)
    return GemmPlan(bm, bn, bk, 8, warps, stages, need)
