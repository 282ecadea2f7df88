"""MLA latent-cache write kernels (K3.md section 3; see mla.py's module doc for the paged pool): the one-kernel form
(prefill) and the split-K form for few rows (decode, short appends: partials, then a fixed-order reduce)."""
from __future__ import annotations

from dataclasses import dataclass

from ..kernel import KernelSource
from ..targets import Target
from ..writer import SourceWriter, fnum, ident, name_part
from .common import ELEM_BYTES, TL_DTYPE, check_dim, check_float, clamp, emit_math_helpers, interpreted, \
    pow2_ceil, to_dtype
from .mla_common import FP8_MAX, LATENT_FP8, _blk, _check_eps, _dot_parts, latent_row_width, latent_scale_index


# -- latent write ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LatentWritePlan:
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int


def latent_write_plan(hidden: int, width: int, elem_bytes: int, target: Target) -> LatentWritePlan:
    """BLOCK_M rows x the whole 576-wide row (RMSNorm needs all of c): BLOCK_M 16 (a 32-row accumulator
    [32, 512] spills on sm_90); BLOCK_K the largest of 64/32/16 whose two-stage pipeline fits 7/8 of shared
    memory. One plan for every token count: decode's few rows take the split-K form instead."""
    bm = 16
    wide = pow2_ceil(width)
    bk = min(64, pow2_ceil(hidden))
    stages = 1
    if target.shared_mem_bytes > 0:
        budget = target.shared_mem_bytes - target.shared_mem_bytes // 8
        while bk > 16 and 2 * (bm + wide) * bk * elem_bytes > budget:
            bk //= 2
        stages = clamp(budget // max(1, (bm + wide) * bk * elem_bytes), 1, 3)
    return LatentWritePlan(bm, max(16, bk), 4 if bm == 16 else 8, stages)


def _check_cache_dtype(cache_dtype: str) -> str:
    return cache_dtype if cache_dtype == LATENT_FP8 else check_float(cache_dtype, "cache_dtype")


def _pool_args(cdt: str) -> dict[str, str]:
    """The pool's kernel args: the rows, and for an fp8 cache the same memory as fp32 words (the rows' scales)."""
    if cdt == LATENT_FP8:
        return {"pool_ptr": f"*{cdt}", "scale_ptr": "*fp32"}
    return {"pool_ptr": f"*{cdt}"}


def _emit_row_store(w: SourceWriter, cdt: str, interp: bool, *, tile: bool) -> None:
    """Store the row(s) c [.., L] | acc_r [.., R] (fp32) at element offset `slot` of the pool in its layout
    (mla_common's module doc): `tile` = [BLOCK_M, ..] rows masked by m_ok, else one row."""
    ml, mr = ("m_ok[:, None] & l_ok[None, :]", "m_ok[:, None] & r_ok[None, :]") if tile else ("l_ok", "r_ok")
    sl = "slot[:, None] + offs_l[None, :]" if tile else "slot + offs_l"
    sr = "slot[:, None] + L + offs_r[None, :]" if tile else "slot + L + offs_r"
    if cdt != LATENT_FP8:
        w.line(f"tl.store(pool_ptr + {sl}, {to_dtype('c', cdt, interp)}, mask={ml})")
        w.line(f"tl.store(pool_ptr + {sr}, {to_dtype('acc_r', cdt, interp)}, mask={mr})")
        return
    ax, col = (1, "[:, None]") if tile else (0, "")
    w.comment("fp8 row: per-token scale of each part = amax / 448 (padded columns are exactly 0)")
    for part, val in (("c", "c"), ("r", "acc_r")):
        w.line(f"amax_{part} = tl.max(tl.abs({val}), axis={ax})")
        w.line(f"sc_{part} = tl.where(amax_{part} > 0.0, amax_{part} / {fnum(FP8_MAX)}, 1.0)")
        clamped = f"tl.minimum(tl.maximum({val} / sc_{part}{col}, {fnum(-FP8_MAX)}), {fnum(FP8_MAX)})"
        w.line(f"q_{part} = {to_dtype(clamped, cdt, interp)}")
    w.line(f"tl.store(pool_ptr + {sl}, q_c, mask={ml})")
    w.line(f"tl.store(pool_ptr + {sr}, q_r, mask={mr})")
    w.line("si = slot // 4 + SCALE_AT  # ROW is a multiple of 16 bytes: slot // 4 is exact")
    w.line("tl.store(scale_ptr + si, sc_c" + (", mask=m_ok)" if tile else ")"))
    w.line("tl.store(scale_ptr + si + 1, sc_r" + (", mask=m_ok)" if tile else ")"))


def _row_constexprs(L: int, R: int, cdt: str) -> dict[str, int]:
    cx = {"ROW": latent_row_width(L, R, cdt)}
    if cdt == LATENT_FP8:
        cx["SCALE_AT"] = latent_scale_index(L, R)
    return cx


def _emit_latent_cols(w: SourceWriter) -> None:
    """The row's column indices and masks: L latent columns, then R rope columns (both forms of the write)."""
    w.line("offs_l = tl.arange(0, BLOCK_L)")
    w.line("offs_r = tl.arange(0, BLOCK_R)")
    w.line("l_ok = offs_l < L")
    w.line("r_ok = offs_r < R")


def emit_mla_latent_write(hidden: int, kv_lora_rank: int, rope_dim: int, eps: float, page_size: int, *,
                          target: Target, dtype: str = "bf16", w_dtype: str | None = None,
                          cache_dtype: str | None = None, name: str | None = None,
                          ir_op: str = "mla_absorbed", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Kernel args: x_ptr [B*T, D], w_ptr [L+R, D] (kv_a_proj_with_mqa), nw_ptr [L] (kv_a_layernorm),
    pool_ptr [pages, PS, L+R], bt_ptr i32 [B, max_pages], start_ptr i32 [B] (position of each sequence's first new
    token), T, max_pages, B; grid (cdiv(T, BLOCK_M), B)."""
    D, L, PS = check_dim(hidden, "hidden"), check_dim(kv_lora_rank, "kv_lora_rank"), check_dim(page_size, "page")
    R = check_dim(rope_dim, "qk_rope_head_dim")
    dt = check_float(dtype)
    wdt = check_float(w_dtype or dt, "w_dtype")
    cdt = _check_cache_dtype(cache_dtype or dt)
    _check_eps(eps)
    W = L + R
    interp = interpreted(target, interpret)
    plan = latent_write_plan(D, W, max(ELEM_BYTES[dt], ELEM_BYTES[wdt]), target)
    up, dot_kw = _dot_parts(dt, interp)
    kname = ident(name or f"k3c_mla_latent_write_d{D}_l{L}_r{R}_p{PS}_{name_part(dt)}_m{plan.block_m}"
                  + (f"_c{name_part(cdt)}" if cdt != dt else ""))
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{wdt}", "nw_ptr": f"*{wdt}", **_pool_args(cdt), "bt_ptr": "*i32",
           "start_ptr": "*i32", "T": "i32", "max_pages": "i32", "B": "i32"}
    cx = {"D": D, "L": L, "R": R, "PS": PS, "BLOCK_M": plan.block_m, "BLOCK_K": plan.block_k,
          "BLOCK_L": _blk(L), "BLOCK_R": _blk(R), **_row_constexprs(L, R, cdt)}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"mla latent write: [RMSNorm(x Wc^T) | x Wr^T] -> pages; D={D} L={L} R={R} PS={PS} eps={fnum(eps)}",
                    f"x:{dt} w:{wdt} cache:{cdt} BLOCK_M={plan.block_m} BLOCK_K={plan.block_k} "
                    f"stages={plan.num_stages}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and cdt == "bf16", rtne_e4m3=interp and cdt == LATENT_FP8)
    with w.jit_function(kname, list(sig), list(cx)):
        w.line("pid_m = tl.program_id(0)")
        w.line("b = tl.program_id(1).to(tl.int64)")
        w.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        w.line("m_ok = offs_m < T")
        w.line("rows = b * T + tl.where(m_ok, offs_m, 0).to(tl.int64)")
        w.line("offs_k = tl.arange(0, BLOCK_K)")
        _emit_latent_cols(w)
        w.line("acc_c = tl.zeros((BLOCK_M, BLOCK_L), dtype=tl.float32)")
        w.line("acc_r = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)")
        w.line("for k0 in range(0, D, BLOCK_K):")
        with w.indent():
            w.line("kk = k0 + offs_k")
            w.line("k_ok = kk < D")
            w.line("a = tl.load(x_ptr + rows[:, None] * D + kk[None, :], mask=k_ok[None, :], other=0.0)")
            w.line("wc = tl.load(w_ptr + offs_l.to(tl.int64)[None, :] * D + kk[:, None], "
                   "mask=l_ok[None, :] & k_ok[:, None], other=0.0)")
            w.line("wr = tl.load(w_ptr + (L + offs_r).to(tl.int64)[None, :] * D + kk[:, None], "
                   "mask=r_ok[None, :] & k_ok[:, None], other=0.0)")
            if wdt != dt:
                w.line(f"wc = wc.to({TL_DTYPE[dt]})")
                w.line(f"wr = wr.to({TL_DTYPE[dt]})")
            w.line(f"acc_c = tl.dot(a{up}, wc{up}, acc_c{dot_kw})")
            w.line(f"acc_r = tl.dot(a{up}, wr{up}, acc_r{dot_kw})")
        w.comment("epilogue: RMSNorm over the L latent columns (padded columns are exactly 0)")
        w.line(f"rstd = tl.rsqrt(tl.sum(acc_c * acc_c, axis=1) / L + {fnum(eps)})")
        w.line("nw = tl.load(nw_ptr + offs_l, mask=l_ok, other=0.0).to(tl.float32)")
        w.line("c = acc_c * rstd[:, None] * nw[None, :]")
        w.comment("paged store: int64 page offsets")
        w.line("pos = tl.load(start_ptr + b) + offs_m")
        w.line("page = tl.load(bt_ptr + b * max_pages + pos // PS, mask=m_ok, other=0).to(tl.int64)")
        w.line("slot = page * (PS * ROW) + (pos % PS).to(tl.int64) * ROW")
        _emit_row_store(w, cdt, interp, tile=True)
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("cdiv(T, BLOCK_M)", "B"), num_warps=plan.num_warps, num_stages=plan.num_stages,
                        ir_op=ir_op, loc=loc)


# -- latent write, split-K form (decode, short appends) ------------------------------------------------------------
LATENT_SPLIT_MAX_ROWS = 256     # B*T rows at or below which the runtime writes the latent rows in the split-K form


@dataclass(frozen=True)
class LatentSplitPlan:
    block_m: int        # rows (B*T flattened) per program
    block_n: int        # latent columns (of the L+R row) per program
    block_k: int        # reduction step
    num_warps: int
    num_stages: int

    @property
    def tag(self) -> str:
        return f"m{self.block_m}_n{self.block_n}_k{self.block_k}"


def latent_split_plan(rows: int, hidden: int, elem_bytes: int, target: Target) -> LatentSplitPlan:
    """Tiles of the split-K partial kernel: BLOCK_M 16 for <= 16 rows, else 64 (one row tile for decode up to
    B=64: the weight is read once; two kernels in all), BLOCK_N 64 (576 = 9 column tiles), BLOCK_K 128 for 2-byte
    operands (64 for fp32) shrunk until the pipeline fits 7/8 of shared memory, 8 warps; 3 stages on 32-lane
    targets, 2 on 64-lane ones (a split is a few K steps: the stages put all of them in flight at once). No spills
    on sm_90 or gfx950 (4 warps with m64 x k128 spill on sm_90; the AOT resource figures: docs/perf.md, "Plan
    rules"). The interpreter gets 16 x 16 x 16 tiles (several column tiles and K splits at test shapes)."""
    if target.shared_mem_bytes <= 0:
        return LatentSplitPlan(16, 16, 16, 4, 1)
    bm = 16 if rows <= 16 else 64
    bn = 64
    bk = min(128 if elem_bytes <= 2 else 64, max(16, pow2_ceil(hidden)))
    stages = 2 if target.warp_size >= 64 else 3
    budget = target.shared_mem_bytes - target.shared_mem_bytes // 8
    while bk > 16 and stages * (bm + bn) * bk * elem_bytes > budget:
        bk //= 2
    return LatentSplitPlan(bm, bn, bk, 8, stages)


def emit_mla_latent_partial(hidden: int, width: int, *, target: Target, dtype: str = "bf16",
                            w_dtype: str | None = None, rows_hint: int = 1, plan: LatentSplitPlan | None = None,
                            name: str | None = None, ir_op: str = "mla_absorbed", loc: str = "",
                            interpret: bool | None = None) -> KernelSource:
    """Phase A of the split-K latent write: fp32 partial sums of x W_dkv^T over one slice of the reduction.
    Kernel args: x_ptr [M, D] (M = B*T rows), w_ptr [W, D] (kv_a_proj_with_mqa, W = L+R), ws_ptr fp32 [S, M, W],
    M, k_split (reduction elements per split, a multiple of BLOCK_K), S (= cdiv(D, k_split));
    grid (cdiv(W, BLOCK_N), S, cdiv(M, BLOCK_M)). Program (n, s, m) writes ws[s, m tile, n tile] = x[m tile,
    s-th slice] W[n tile, s-th slice]^T: every element written by exactly one program (no atomics), so the sum
    that emit_mla_latent_reduce forms is deterministic."""
    D, W = check_dim(hidden, "hidden"), check_dim(width, "width")
    dt = check_float(dtype)
    wdt = check_float(w_dtype or dt, "w_dtype")
    interp = interpreted(target, interpret)
    plan = plan or latent_split_plan(rows_hint, D, max(ELEM_BYTES[dt], ELEM_BYTES[wdt]), target)
    up, dot_kw = _dot_parts(dt, interp)
    kname = ident(name or f"k3c_mla_latent_write_split_d{D}_w{W}_{name_part(dt)}"
                  + (f"_{name_part(wdt)}" if wdt != dt else "") + f"_{plan.tag}")
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{wdt}", "ws_ptr": "*fp32", "M": "i32", "k_split": "i32", "S": "i32"}
    cx = {"D": D, "W": W, "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k}
    even_k = D % plan.block_k == 0
    even_n = W % plan.block_n == 0
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"mla latent write, split-K phase A: fp32 partials of x W_dkv^T; D={D} W={W}",
                    f"x:{dt} w:{wdt} BLOCK_M={plan.block_m} BLOCK_N={plan.block_n} BLOCK_K={plan.block_k} "
                    f"stages={plan.num_stages}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    with w.jit_function(kname, list(sig), list(cx)):
        w.line("pid_n = tl.program_id(0)")
        w.line("pid_s = tl.program_id(1)")
        w.line("pid_m = tl.program_id(2)")
        w.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        w.line("m_ok = offs_m < M")
        w.line("rows = tl.where(m_ok, offs_m, 0).to(tl.int64)")
        w.line("cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        w.line("n_ok = cols < W")
        w.line("wrow = tl.where(n_ok, cols, 0).to(tl.int64) * D  # padded columns re-read column 0, never stored")
        w.line("offs_k = tl.arange(0, BLOCK_K)")
        w.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        w.line("k_lo = tl.multiple_of(pid_s * k_split, BLOCK_K)  # 16-byte aligned K steps: async copies")
        w.line("for k0 in range(k_lo, tl.minimum(k_lo + k_split, D), BLOCK_K):")
        with w.indent():
            w.line("kk = k0 + offs_k")
            if even_k:
                w.line("a = tl.load(x_ptr + rows[:, None] * D + kk[None, :])")
                w.line("b = tl.load(w_ptr + wrow[None, :] + kk[:, None])")
            else:
                w.line("k_ok = kk < D")
                w.line("a = tl.load(x_ptr + rows[:, None] * D + kk[None, :], mask=k_ok[None, :], other=0.0)")
                w.line("b = tl.load(w_ptr + wrow[None, :] + kk[:, None], mask=k_ok[:, None], other=0.0)")
            if wdt != dt:
                w.line(f"b = b.to({TL_DTYPE[dt]})")
            w.line(f"acc = tl.dot(a{up}, b{up}, acc{dot_kw})")
        w.line("out = (pid_s.to(tl.int64) * M + rows) * W")
        w.line("tl.store(ws_ptr + out[:, None] + cols[None, :], acc, mask=m_ok[:, None]"
               + ("" if even_n else " & n_ok[None, :]") + ")")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("cdiv(W, BLOCK_N)", "S", "cdiv(M, BLOCK_M)"), num_warps=plan.num_warps,
                        num_stages=plan.num_stages, ir_op=ir_op, loc=loc)


LATENT_REDUCE_TILE = 4096   # elements of the [BLOCK_S, BLOCK_L] tile of partials the reduce reads per step


def emit_mla_latent_reduce(kv_lora_rank: int, rope_dim: int, eps: float, page_size: int, *, target: Target,
                           w_dtype: str = "bf16", cache_dtype: str = "bf16", name: str | None = None,
                           ir_op: str = "mla_absorbed", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Phase B of the split-K latent write: one program per row sums the S partials in a fixed order (BLOCK_S of
    them a step, each step a fixed tl.sum tree), applies the RMSNorm to the L latent columns and stores the row
    [c | k_pe] into its page, as emit_mla_latent_write does. Kernel args: ws_ptr fp32 [S, M, L+R], nw_ptr [L]
    (kv_a_layernorm), pool_ptr [pages, PS, L+R], bt_ptr i32 [B, max_pages], start_ptr i32 [B], T, max_pages, M
    (= B*T), S; grid (M,)."""
    L, R, PS = check_dim(kv_lora_rank, "kv_lora_rank"), check_dim(rope_dim, "qk_rope_head_dim"), \
        check_dim(page_size, "page")
    wdt = check_float(w_dtype, "w_dtype")
    cdt = _check_cache_dtype(cache_dtype)
    _check_eps(eps)
    interp = interpreted(target, interpret)
    bl, br = _blk(L), _blk(R)
    bs = clamp(LATENT_REDUCE_TILE // bl, 2, 32)
    kname = ident(name or f"k3c_mla_latent_write_reduce_l{L}_r{R}_p{PS}_{name_part(cdt)}"
                  + (f"_{name_part(wdt)}" if wdt != cdt else ""))
    sig = {"ws_ptr": "*fp32", "nw_ptr": f"*{wdt}", **_pool_args(cdt), "bt_ptr": "*i32", "start_ptr": "*i32",
           "T": "i32", "max_pages": "i32", "M": "i32", "S": "i32"}
    cx = {"L": L, "R": R, "PS": PS, "BLOCK_L": bl, "BLOCK_R": br, "BLOCK_S": bs, **_row_constexprs(L, R, cdt)}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"mla latent write, split-K phase B: sum of partials, RMSNorm, paged store; L={L} R={R} "
                    f"PS={PS} eps={fnum(eps)}",
                    f"norm w:{wdt} cache:{cdt} BLOCK_S={bs}" + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and cdt == "bf16", rtne_e4m3=interp and cdt == LATENT_FP8)
    with w.jit_function(kname, list(sig), list(cx)):
        w.line("row = tl.program_id(0).to(tl.int64)")
        w.line("b = row // T")
        w.line("offs_s = tl.arange(0, BLOCK_S)")
        _emit_latent_cols(w)
        w.line("acc_c = tl.zeros((BLOCK_L,), dtype=tl.float32)")
        w.line("acc_r = tl.zeros((BLOCK_R,), dtype=tl.float32)")
        w.comment("fixed summation order (splits in ascending blocks, one tl.sum tree each): deterministic")
        w.line("for s0 in range(0, S, BLOCK_S):")
        with w.indent():
            w.line("ss = s0 + offs_s")
            w.line("s_ok = ss < S")
            w.line("src = (ss.to(tl.int64) * M + row) * (L + R)")
            w.line("acc_c += tl.sum(tl.load(ws_ptr + src[:, None] + offs_l[None, :], "
                   "mask=s_ok[:, None] & l_ok[None, :], other=0.0), axis=0)")
            w.line("acc_r += tl.sum(tl.load(ws_ptr + src[:, None] + L + offs_r[None, :], "
                   "mask=s_ok[:, None] & r_ok[None, :], other=0.0), axis=0)")
        w.comment("RMSNorm over the L latent columns (padded columns are exactly 0)")
        w.line(f"rstd = tl.rsqrt(tl.sum(acc_c * acc_c, axis=0) / L + {fnum(eps)})")
        w.line("nw = tl.load(nw_ptr + offs_l, mask=l_ok, other=0.0).to(tl.float32)")
        w.line("c = acc_c * rstd * nw")
        w.comment("paged store: int64 page offsets")
        w.line("pos = tl.load(start_ptr + b) + (row - b * T).to(tl.int32)")
        w.line("page = tl.load(bt_ptr + b * max_pages + pos // PS).to(tl.int64)")
        w.line("slot = page * (PS * ROW) + (pos % PS).to(tl.int64) * ROW")
        _emit_row_store(w, cdt, interp, tile=False)
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx, grid=("M",),
                        num_warps=4, num_stages=1, ir_op=ir_op, loc=loc)
