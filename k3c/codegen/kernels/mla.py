"""MLA kernels (K3.md section 3): latent-cache write, MQA split-KV flash-decoding over pages, LSE merge, and the
MHA causal flash-attention step used (chunk by chunk) for prefill and append-prefill.

Paged latent cache: a pool [num_pages, PS, L+R] (PS = Target.mla_page_size) and a block table i32 [B, max_pages];
token at position `pos` of sequence b lives at pool[bt[b, pos // PS], pos % PS]. Every pool / row offset is formed
in int64 (`page.to(tl.int64) * PAGE_STRIDE`): a pool past 2^31 elements (B=128 x 32K tokens x 576) is addressed
correctly (tests/mla/test_mla_offsets.py runs the kernels on one).

Kernels (the three latent-write ones live in mla_latent.py and are re-exported here):
  emit_mla_latent_write   kv = x W_dkv^T with RMSNorm(c) fused into the epilogue, stored into the pages; grid
                          (cdiv(T, 16), B): every program streams the whole weight (prefill)
  emit_mla_latent_partial the split-K form for few rows (decode, short appends): phase A, programs over (column
                          tiles, K splits, row tiles of B*T) write fp32 partials [S, B*T, L+R] (no atomics)
  emit_mla_latent_reduce  phase B: one program per row sums the S partials in a fixed order, RMSNorm, paged store
  emit_mla_decode         MQA split-KV flash-decoding: one program = one sequence x one KV split x BLOCK_H query
                          rows (rows = query tokens x heads); each page is loaded once per head tile and serves all
                          its rows; causal mask per row (query length >= 1: short appends, speculative tokens);
                          writes a normalised partial o [S, B*ROWS, L] (fp32) and its log-sum-exp [S, B*ROWS]
  emit_mla_merge          merges S partials by log-sum-exp: out = sum_s e^{lse_s - m} o_s / sum_s e^{lse_s - m}
  emit_mla_prefill        MHA causal flash attention of q [B, Tq, N, P+R] against one chunk of expanded keys
                          k_nope [B, Tk, N, P] | k_pe (shared, read from the latent rows) and values [B, Tk, N, V];
                          with HAS_PREV it continues from the running (o, lse) of the previous chunks, which is the
                          log-sum-exp merge done in the prologue (exact), so no chunk's K/V outlives its step
All scores, softmax statistics and accumulators are fp32; bf16 operands feed tl.dot (fp32 accumulation).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part
from .common import TL_DTYPE, check_dim, check_float, clamp, emit_math_helpers, interpreted, pow2_ceil, to_dtype
from .mla_common import LATENT_FP8, LOG2E, _blk, _check_scale, _dot_parts, _p_cast, latent_row_width, \
    latent_scale_index
from .mla_hopper import BLOCK_H as HOPPER_BLOCK_H, NUM_WARPS as HOPPER_NUM_WARPS, hopper_decode_supported
from .mla_latent import (LATENT_SPLIT_MAX_ROWS, emit_mla_latent_partial, emit_mla_latent_reduce, emit_mla_latent_write,
                         latent_split_plan)


# -- MQA decode (split-KV) ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodePlan:
    block_h: int        # query rows (tokens x heads) per program: each key tile load serves all of them
    num_warps: int
    num_stages: int
    block_n: int | None = None      # keys per step (a divisor of the page); None: the whole page
    keys_major: bool = False        # scores as K q^T (q^T the MMA's B operand, from shared memory)
    lazy: bool = False              # rescale the accumulator only when a row's running max grows (exact)
    tier: str = "portable"          # "hopper": the Gluon kernel of kernels/mla_hopper.py (k3c.codegen.tiers)


HOPPER_DECODE_MIN_ROWS = 17   # fewer rows (12 heads, one token) stay on the portable 16-row tile (measured)
DECODE_MAX_ROWS = 32     # fp32 accumulator [BLOCK_H, L] <= [32, 512] in a plain tile: the largest without spills


def decode_plan(rows: int, kv_lora_rank: int, target: Target, block_h: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None,
                block_n: int | None = None, cache_dtype: str | None = None, tiers: bool = True,
                rope_dim: int | None = None) -> DecodePlan:
    """The shipped decode plan by shape (rows = query tokens x heads of one sequence).

    Targets with the hopper tier (h100, h200), a bf16 cache, the shapes kernels/mla_hopper.py serves (rope_dim
    given) and more than 16 rows: the Gluon kernel (64-row head tiles over two warpgroups, the seesaw schedule). On
    an H100 its lockstep schedule was 1.15-1.54x the portable kernel at 96 heads; the seesaw is 1.16-1.19x the
    lockstep at batch 32-128, 32K keys on an H200 (level at 4K, 7-8% slower at batch 1). At 12 heads (one 16-row
    tile) the portable kernel is level or 1-8% faster at batch >= 32 (bench/mla_hopper.py; docs/perf.md).
    `tiers=False` asks for the portable plan (the runtime's fallback where a tier kernel can be neither loaded nor
    built: k3c.codegen.tiers).

    sm_90 (H100 / H200), 512-wide latent: 16-row head tiles, 4 warps, whole pages, 2 stages, for every head count
    (12 heads: one tile, each page loaded once; 96 heads: six tiles, the page re-reads mostly hit L2): the fastest
    spill-free plan of bench/mla.py's sweep (the figures: docs/perf.md, "Plan rules"); the only faster plan
    spills on sm_90, which no shipped kernel may. Otherwise: BLOCK_H = all rows when they
    fit, else even head tiles of <= 32 rows; 64-lane targets feed the MFMA operands from registers, so they step
    through a page 16 or 32 keys at a time. Every shipped plan compiles without spills
    (tests/codegen/test_artifact_kernels.py).

    An fp8 cache (cache_dtype LATENT_FP8) on sm_90: the codes widen to bf16 in registers before the dots, so a
    whole 64-key page spills (856 B). 16 keys a step, 4 warps, 3 stages is the fastest spill-free plan of an H200
    sweep (254 registers; docs/perf.md, MLA fp8 cache): still 0.35x the bf16 cache's speed at 12 heads, 0.27x at 96."""
    if tiers and target.has_tier("hopper") and rows >= HOPPER_DECODE_MIN_ROWS and rope_dim is not None \
            and cache_dtype == "bf16" and block_h is None and num_warps is None and num_stages is None \
            and block_n is None \
            and hopper_decode_supported(kv_lora_rank, rope_dim, target.mla_page_size, "bf16", "bf16", target):
        return DecodePlan(HOPPER_BLOCK_H, HOPPER_NUM_WARPS, 1, tier="hopper")
    lat = pow2_ceil(kv_lora_rank)
    wide = target.warp_size >= 64
    gpu = target.shared_mem_bytes > 0
    if block_h is None and target.arch == "sm_90" and lat == 512 and num_warps is None and num_stages is None \
            and block_n is None:
        return DecodePlan(16, 4, 3, 16) if cache_dtype == LATENT_FP8 else DecodePlan(16, 4, 2)
    if block_h is None:
        cap = max(16, DECODE_MAX_ROWS * 512 // max(512, lat))
        tiles = -(-rows // cap)
        block_h = clamp(pow2_ceil(-(-rows // tiles)), 16, cap)
    warps = num_warps or clamp(block_h * lat * 4 // (max(1, target.warp_size) * 4 * 64), 4, 8)
    if block_n is None and wide:
        block_n = 16 if block_h > 16 else 32
    stages = num_stages or (1 if not gpu or (wide and block_h > 16) else 2)
    return DecodePlan(block_h, warps, stages, block_n)


def _emit_decode_prologue(w: SourceWriter, keys_major: bool, *, full_l: bool, full_r: bool) -> None:
    """The decode program's rows, its query tiles, its split's page range (full pages first) and the online
    softmax state."""
    w.line("pid_h = tl.program_id(0)")
    w.line("split = tl.program_id(1)")
    w.line("b = tl.program_id(2).to(tl.int64)")
    w.line("seq_len = tl.load(lens_ptr + b)")
    w.line("rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)")
    w.line("row_ok = rows < ROWS")
    w.line("offs_l = tl.arange(0, BLOCK_L)")
    w.line("offs_r = tl.arange(0, BLOCK_R)")
    w.line("offs_n = tl.arange(0, BLOCK_N)")
    w.line("l_ok = offs_l < L")
    w.line("r_ok = offs_r < R")
    w.line("q_row = (b * ROWS + tl.where(row_ok, rows, 0).to(tl.int64)) * (L + R)")
    qlm = "" if full_l else ", mask=l_ok[None, :], other=0.0"
    qrm = "" if full_r else ", mask=r_ok[None, :], other=0.0"
    w.line(f"ql = tl.load(q_ptr + q_row[:, None] + offs_l[None, :]{qlm})")
    w.line(f"qr = tl.load(q_ptr + q_row[:, None] + L + offs_r[None, :]{qrm})")
    if keys_major:
        w.line("qlt = tl.trans(ql)  # scores as K q^T: the key tile is the MMA's A operand, q^T its B")
        w.line("qrt = tl.trans(qr)")
    w.line("n_pages = tl.cdiv(seq_len, PS)")
    w.line("p_begin = split * pages_per_split")
    w.line("p_end = tl.minimum(p_begin + pages_per_split, n_pages)")
    w.line("m_i = tl.full((BLOCK_H,), float('-inf'), dtype=tl.float32)")
    w.line("l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)")
    w.line("acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)")
    w.line("bt_row = bt_ptr + b * max_pages")
    w.line("offs_kv = offs_n[:, None] * ROW  # i32 offsets inside one page step (the base is a scalar)")
    w.comment("pages wholly visible to every row (keys <= seq_len - TQ) need no masks: unmasked loads feed the "
              "MMA straight from shared memory; the rest (the last page, the causal band of a multi-token "
              "query) is the masked tail loop")
    w.line("p_full = tl.maximum(tl.minimum(p_end, (seq_len - TQ + 1) // PS), p_begin)")


def _emit_decode_step(w: SourceWriter, *, masked: bool, keys_major: bool, lazy: bool, up: str, dot_kw: str,
                      p_cast: str, scale: float, lmask: str, rmask: str, fp8: str | None) -> None:
    """One step of the decode loop: BLOCK_N keys of a page (masked: the causal limit per row and the sequence end),
    their scores for every row, and the online softmax update of (m_i, l_i, acc) in the log2 domain. fp8: the
    query's dtype; the e4m3 codes widen to it exactly, the per-key scales multiply the two score parts and, for
    the values, the softmax weights (l_i sums the unscaled weights)."""
    w.line("p = it // (PS // BLOCK_N)")
    w.line("sub = (it % (PS // BLOCK_N)) * BLOCK_N")
    w.line("page = tl.load(bt_row + p).to(tl.int64)")
    w.line("row0 = page * (PS * ROW) + sub * ROW")
    w.line("kv = pool_ptr + row0")
    widen = f".to({TL_DTYPE[fp8]})" if fp8 else ""
    if masked:
        w.line("qpos = seq_len - TQ + rows // NH  # each row's query position (causal limit)")
        w.line("kpos = p * PS + sub + offs_n")
        w.line("live = (kpos < seq_len)[:, None]  # slots past the end may hold anything (NaN): never read")
        cm = " & ".join(x for x in ("live", lmask) if x)
        rm = " & ".join(x for x in ("live", rmask) if x)
        w.line(f"c = tl.load(kv + offs_kv + offs_l[None, :], mask={cm}, other=0.0){widen}  # keys = values")
        w.line(f"kr = tl.load(kv + offs_kv + L + offs_r[None, :], mask={rm}, other=0.0){widen}")
        if fp8:
            w.line("sk = scale_ptr + (row0 // 4 + SCALE_AT) + offs_n * (ROW // 4)")
            w.line("sc = tl.load(sk, mask=kpos < seq_len, other=0.0)")
            w.line("sr = tl.load(sk + 1, mask=kpos < seq_len, other=0.0)")
    else:
        cm = f", mask={lmask}, other=0.0" if lmask else ""
        rm = f", mask={rmask}, other=0.0" if rmask else ""
        w.line(f"c = tl.load(kv + offs_kv + offs_l[None, :]{cm}){widen}  # [BLOCK_N, L]: keys = values")
        w.line(f"kr = tl.load(kv + offs_kv + L + offs_r[None, :]{rm}){widen}  # [BLOCK_N, R]")
        if fp8:
            w.line("sk = scale_ptr + (row0 // 4 + SCALE_AT) + offs_n * (ROW // 4)  # per-key scales")
            w.line("sc = tl.load(sk)")
            w.line("sr = tl.load(sk + 1)")
    if keys_major and fp8:
        w.line(f"s = tl.trans(tl.dot(c{up}, qlt{up}{dot_kw}) * sc[:, None] + tl.dot(kr{up}, qrt{up}{dot_kw}) "
               "* sr[:, None])")
    elif keys_major:
        w.line(f"s = tl.trans(tl.dot(c{up}, qlt{up}{dot_kw}) + tl.dot(kr{up}, qrt{up}{dot_kw}))")
    elif fp8:
        w.line(f"s = tl.dot(ql{up}, tl.trans(c{up}){dot_kw}) * sc[None, :] "
               f"+ tl.dot(qr{up}, tl.trans(kr{up}){dot_kw}) * sr[None, :]")
    else:
        w.line(f"s = tl.dot(ql{up}, tl.trans(c{up}){dot_kw})")
        w.line(f"s = tl.dot(qr{up}, tl.trans(kr{up}), s{dot_kw})")
    if masked:
        w.line("ok = (kpos[None, :] <= qpos[:, None]) & (kpos < seq_len)[None, :]")
        w.line(f"s = tl.where(ok, s * {fnum(scale * LOG2E)}, float('-inf'))  # log2 domain")
        w.line("m_new = tl.maximum(m_i, tl.max(s, axis=1))")
        w.line("m_use = tl.where(m_new == float('-inf'), 0.0, m_new)")
    elif lazy:
        w.line(f"s = s * {fnum(scale * LOG2E)}  # log2 domain; every key visible: the row max is finite")
        w.line("m_new = tl.maximum(m_i, tl.max(s, axis=1))")
        w.line("if tl.max(m_new - m_i, axis=0) > 0.0:  # rescale only when some row's max grew (exact)")
        with w.indent():
            w.line("alpha = tl.exp2(m_i - m_new)")
            w.line("l_i = l_i * alpha")
            w.line("acc = acc * alpha[:, None]")
            w.line("m_i = m_new")
        w.line("p = tl.exp2(s - m_i[:, None])")
        w.line("l_i = l_i + tl.sum(p, axis=1)")
        w.line(f"acc = tl.dot({p_cast}, c{up}, acc{dot_kw})")
        return
    else:
        w.line(f"s = s * {fnum(scale * LOG2E)}  # log2 domain; every key visible: m_new is finite")
        w.line("m_new = tl.maximum(m_i, tl.max(s, axis=1))")
        w.line("m_use = m_new")
    w.line("alpha = tl.exp2(m_i - m_use)")
    w.line("p = tl.exp2(s - m_use[:, None])")
    w.line("l_i = l_i * alpha + tl.sum(p, axis=1)")
    w.line(f"acc = tl.dot({p_cast}, c{up}, acc * alpha[:, None]{dot_kw})")
    w.line("m_i = m_new")


def _emit_normalise(w: SourceWriter) -> None:
    """The flash loops' end: o = acc / l and its natural-log LSE (rows that saw no key: o = 0, lse = -inf)."""
    w.line("has = l_i > 0.0")
    w.line("o = acc / tl.where(has, l_i, 1.0)[:, None]")
    w.line(f"lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * {fnum(1.0 / LOG2E)}, float('-inf'))")


def emit_mla_decode(kv_lora_rank: int, rope_dim: int, page_size: int, scale: float, *, target: Target,
                    dtype: str = "bf16", cache_dtype: str | None = None, block_h: int = 16, num_warps: int = 4,
                    num_stages: int = 2, block_n: int | None = None, keys_major: bool = False, lazy: bool = False,
                    name: str | None = None,
                    ir_op: str = "mla_absorbed", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Kernel args: q_ptr [B, ROWS, L+R] ([q_lat | q_pe], rows = token-major (t, head)), pool_ptr (rows in the
    layout of `cache_dtype`, default `dtype`: mla_common's module doc; an fp8 pool is followed by scale_ptr, the
    same memory as fp32 words), bt_ptr i32,
    lens_ptr i32 [B] (total tokens incl. the new ones), o_ptr fp32 [S, B, ROWS, L], lse_ptr fp32 [S, B, ROWS],
    ROWS, NH (heads: the row's query token is row // NH), TQ, max_pages, pages_per_split, B, S;
    grid (cdiv(ROWS, BLOCK_H), S, B)."""
    L, R, PS = check_dim(kv_lora_rank, "kv_lora_rank"), check_dim(rope_dim, "rope"), check_dim(page_size, "page")
    dt = check_float(dtype)
    cdt = cache_dtype or dt
    if cdt not in (dt, LATENT_FP8):
        raise CodegenError(f"decode: the cache holds {dt} rows or fp8 ({LATENT_FP8}) rows, got {cdt!r}")
    if cdt == LATENT_FP8 and dt == "fp32":
        raise CodegenError("decode: an fp8 cache is read by bf16 / fp16 queries")
    fp8 = dt if cdt == LATENT_FP8 else None
    _check_scale(scale)
    interp = interpreted(target, interpret)
    up, dot_kw = _dot_parts(dt, interp)
    bh = check_dim(block_h, "block_h")
    bn = check_dim(block_n or PS, "block_n")
    if PS % bn or bn & (bn - 1):
        raise CodegenError(f"block_n {bn} must be a power of two dividing the page size {PS}")
    kname = ident(name or f"k3c_mla_decode_l{L}_r{R}_p{PS}_{name_part(dt)}_h{bh}_w{num_warps}_s{num_stages}"
                  + (f"_n{bn}" if bn != PS else "") + ("_kq" if keys_major else "") + ("_lz" if lazy else "")
                  + ("_c8" if fp8 else ""))
    pool = {"pool_ptr": f"*{cdt}", "scale_ptr": "*fp32"} if fp8 else {"pool_ptr": f"*{dt}"}
    sig = {"q_ptr": f"*{dt}", **pool, "bt_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*fp32",
           "lse_ptr": "*fp32", "ROWS": "i32", "NH": "i32", "TQ": "i32", "max_pages": "i32",
           "pages_per_split": "i32", "B": "i32", "S": "i32"}
    if (block_n or PS) < 16 and not interp:
        raise CodegenError(f"block_n {block_n or PS} < 16: the P @ V dot needs K >= 16 on GPUs")
    cx = {"L": L, "R": R, "PS": PS, "BLOCK_H": bh, "BLOCK_N": bn, "BLOCK_L": _blk(L), "BLOCK_R": _blk(R),
          "ROW": latent_row_width(L, R, cdt)}
    if fp8:
        cx["SCALE_AT"] = latent_scale_index(L, R)
    p_cast = _p_cast(dt, interp, "(p * sc[None, :])" if fp8 else "p")
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"mla MQA split-KV decode over pages: L={L} R={R} PS={PS} scale={fnum(scale)} {dt} cache:{cdt}",
                    f"BLOCK_H={bh} num_warps={num_warps} num_stages={num_stages}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    step = dict(keys_major=keys_major, lazy=lazy, up=up, dot_kw=dot_kw, p_cast=p_cast, scale=scale,
                lmask="" if _blk(L) == L else "l_ok[None, :]", rmask="" if _blk(R) == R else "r_ok[None, :]",
                fp8=fp8)
    with w.jit_function(kname, list(sig), list(cx)):
        _emit_decode_prologue(w, keys_major, full_l=_blk(L) == L, full_r=_blk(R) == R)
        w.line("for it in range(p_begin * (PS // BLOCK_N), p_full * (PS // BLOCK_N)):  # unmasked pages")
        with w.indent():
            _emit_decode_step(w, masked=False, **step)
        w.line("for it in range(p_full * (PS // BLOCK_N), p_end * (PS // BLOCK_N)):  # masked tail")
        with w.indent():
            _emit_decode_step(w, masked=True, **step)
        _emit_normalise(w)
        w.line("out_row = (split.to(tl.int64) * B + b) * ROWS + tl.where(row_ok, rows, 0).to(tl.int64)")
        w.line("tl.store(o_ptr + out_row[:, None] * L + offs_l[None, :], o, mask=row_ok[:, None] & l_ok[None, :])")
        w.line("tl.store(lse_ptr + out_row, lse, mask=row_ok)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("cdiv(ROWS, BLOCK_H)", "S", "B"), num_warps=num_warps, num_stages=num_stages,
                        ir_op=ir_op, loc=loc)


# -- LSE merge ------------------------------------------------------------------------------------------------------
MERGE_TILE = 4096        # elements of the [BLOCK_S, BLOCK_D] tile of partials a merge program reads per step


def emit_mla_merge(width: int, *, target: Target, out_dtype: str = "fp32", block_d: int | None = None,
                   write_lse: bool = True, name: str | None = None, ir_op: str = "mla_absorbed", loc: str = "",
                   interpret: bool | None = None) -> KernelSource:
    """Kernel args: o_ptr fp32 [S, M, D], lse_ptr fp32 [S, M], out_ptr [M, D], out_lse_ptr fp32 [M], M, S;
    grid (M, cdiv(D, BLOCK_D)). Rows whose every split is empty (lse = -inf) get 0 and lse -inf. The splits are
    read BLOCK_S = MERGE_TILE / BLOCK_D (2..32) at a time (a [BLOCK_S] load of lse, a [BLOCK_S, BLOCK_D] load of o),
    so a 64-column merge of 256 splits is 8 wide steps, not 256 dependent loads. block_d None: one program per row (BLOCK_D = the whole row), and then
    out / out_lse may alias split 0 (each program reads its row of every split before it writes); with block_d
    < width several programs share a row: no aliasing, and write_lse=False (out_lse unused) or a separate out_lse
    (written by column block 0)."""
    D = check_dim(width, "width")
    odt = check_float(out_dtype, "out_dtype")
    interp = interpreted(target, interpret)
    bd = pow2_ceil(D) if block_d is None else check_dim(block_d, "block_d")
    if bd & (bd - 1):
        raise CodegenError(f"block_d {bd} must be a power of two")
    bd = min(bd, pow2_ceil(D))       # a column block as wide as the row is the whole-row kernel (one name, one body)
    kname = ident(name or f"k3c_mla_lse_merge_d{D}_{name_part(odt)}" + (f"_c{bd}" if bd < D else "")
                  + ("" if write_lse else "_nolse"))
    sig = {"o_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{odt}", "out_lse_ptr": "*fp32", "M": "i32",
           "S": "i32"}
    cx = {"D": D, "BLOCK_D": bd, "BLOCK_S": clamp(MERGE_TILE // bd, 2, 32)}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"log-sum-exp merge of split partials, D={D} BLOCK_D={bd} out:{odt}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    emit_math_helpers(w, rtne_bf16=interp and odt == "bf16")
    with w.jit_function(kname, list(sig), list(cx)):
        w.line("row = tl.program_id(0).to(tl.int64)")
        w.line("cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)")
        w.line("ok = cols < D")
        w.line("offs_s = tl.arange(0, BLOCK_S)")
        w.line("m = tl.max(tl.load(lse_ptr + offs_s.to(tl.int64) * M + row, mask=offs_s < S, other=float('-inf')), "
               "axis=0)")
        w.line("for s0 in range(BLOCK_S, S, BLOCK_S):")
        with w.indent():
            w.line("ss = s0 + offs_s")
            w.line("m = tl.maximum(m, tl.max(tl.load(lse_ptr + ss.to(tl.int64) * M + row, mask=ss < S, "
                   "other=float('-inf')), axis=0))")
        w.line("m_use = tl.where(m == float('-inf'), 0.0, m)")
        w.line("den = m_use * 0.0")
        w.line("acc = tl.zeros((BLOCK_D,), dtype=tl.float32)")
        w.line("for s0 in range(0, S, BLOCK_S):")
        with w.indent():
            w.line("ss = s0 + offs_s")
            w.line("s_ok = ss < S")
            w.line("srow = ss.to(tl.int64) * M + row")
            w.line("wgt = tl.exp(tl.load(lse_ptr + srow, mask=s_ok, other=float('-inf')) - m_use)  # 0 if empty")
            w.line("o = tl.load(o_ptr + srow[:, None] * D + cols[None, :], mask=s_ok[:, None] & ok[None, :], "
                   "other=0.0)")
            w.line("acc += tl.sum(wgt[:, None] * o, axis=0)")
            w.line("den += tl.sum(wgt, axis=0)")
        w.line("o = acc / tl.where(den > 0.0, den, 1.0)")
        w.line(f"tl.store(out_ptr + row * D + cols, {to_dtype('o', odt, interp)}, mask=ok)")
        if write_lse:
            w.line("if tl.program_id(1) == 0:")
            with w.indent():
                w.line("tl.store(out_lse_ptr + row, tl.where(den > 0.0, m_use + tl.log(tl.where(den > 0.0, den, "
                       "1.0)), float('-inf')))")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("M", "cdiv(D, BLOCK_D)"), num_warps=4, num_stages=1, ir_op=ir_op, loc=loc)


# -- MHA prefill step -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillPlan:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_plan(tq: int, target: Target) -> PrefillPlan:
    """FlashAttention-2 tiles for head dims 128+64 / 128: 128 x 64 with 8 warps for long query runs, 64 x 64 with
    4 otherwise; 64 x 16 on 64-lane targets (MFMA operands in registers: the larger tiles spill on gfx950);
    16 x 16 for the interpreter (small numpy blocks are cheaper there)."""
    if target.shared_mem_bytes <= 0:
        return PrefillPlan(16, 16, 4, 1)
    if target.warp_size >= 64:
        return PrefillPlan(64, 16, 4, 2)
    if tq >= 128:
        return PrefillPlan(128, 64, 8, 2)
    return PrefillPlan(64, 64, 4, 2)


def emit_mla_prefill(nope_dim: int, rope_dim: int, v_dim: int, scale: float, *, target: Target, dtype: str = "bf16",
                     has_prev: bool = False, tq_hint: int = 128, name: str | None = None,
                     ir_op: str = "mla_absorbed", loc: str = "", interpret: bool | None = None) -> KernelSource:
    """Kernel args: q_ptr [B, TQ, N, P+R], k_ptr [B, TK, N, P], kpe_ptr (row r of sequence b at
    b * kpe_bstride + r * kpe_rstride, R values), v_ptr [B, TK, N, V], o_ptr fp32 [B, TQ, N, V] (running output,
    read when HAS_PREV), lse_ptr fp32 [B, TQ, N], TQ, TK, NH, shift (key j is visible to query i when
    j <= i + shift), kpe_bstride, kpe_rstride, B, KS, ks_len; grid (cdiv(TQ, BLOCK_M), NH, B * KS). With KS > 1
    (few query tiles: more programs), split ks covers keys [ks * ks_len, (ks + 1) * ks_len) and writes partial
    [ks] of o_ptr [KS, B, TQ, N, V] / lse_ptr [KS, B, TQ, N], merged by emit_mla_merge; HAS_PREV needs KS = 1."""
    P, R, V = check_dim(nope_dim, "nope"), check_dim(rope_dim, "rope"), check_dim(v_dim, "v")
    dt = check_float(dtype)
    _check_scale(scale)
    interp = interpreted(target, interpret)
    up, dot_kw = _dot_parts(dt, interp)
    plan = prefill_plan(tq_hint, target) if not interp else PrefillPlan(16, 16, 4, 1)
    kname = ident(name or f"k3c_mla_prefill_p{P}_r{R}_v{V}_{name_part(dt)}_m{plan.block_m}"
                  + ("_cont" if has_prev else ""))
    sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "kpe_ptr": f"*{dt}", "v_ptr": f"*{dt}", "o_ptr": "*fp32",
           "lse_ptr": "*fp32", "TQ": "i32", "TK": "i32", "NH": "i32", "shift": "i32", "kpe_bstride": "i64",
           "kpe_rstride": "i32", "B": "i32", "KS": "i32", "ks_len": "i32"}
    cx = {"P": P, "R": R, "V": V, "BLOCK_P": _blk(P), "BLOCK_R": _blk(R), "BLOCK_V": _blk(V),
          "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "HAS_PREV": bool(has_prev)}
    p_cast = _p_cast(dt, interp)
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"mla MHA causal flash attention step: P={P} R={R} V={V} scale={fnum(scale)} {dt} "
                    f"continue={has_prev}", f"BLOCK_M={plan.block_m} BLOCK_N={plan.block_n}"
                    + (" [interpreter variant]" if interp else "")])
    w.imports()
    with w.jit_function(kname, list(sig), list(cx)):
        w.line("pid_m = tl.program_id(0)")
        w.line("h = tl.program_id(1).to(tl.int64)")
        w.line("b = (tl.program_id(2) // KS).to(tl.int64)")
        w.line("ks = tl.program_id(2) % KS  # key split: keys [ks * ks_len, (ks + 1) * ks_len) of the chunk")
        w.line("offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        w.line("m_ok = offs_m < TQ")
        w.line("offs_n = tl.arange(0, BLOCK_N)")
        w.line("offs_p = tl.arange(0, BLOCK_P)")
        w.line("offs_r = tl.arange(0, BLOCK_R)")
        w.line("offs_v = tl.arange(0, BLOCK_V)")
        w.line("p_ok = offs_p < P")
        w.line("r_ok = offs_r < R")
        w.line("v_ok = offs_v < V")
        w.line("row = (b * TQ + tl.where(m_ok, offs_m, 0).to(tl.int64)) * NH + h   # (b, t, h) rows")
        w.line("q_base = q_ptr + row * (P + R)")
        w.line("qn = tl.load(q_base[:, None] + offs_p[None, :], mask=p_ok[None, :], other=0.0)")
        w.line("qr = tl.load(q_base[:, None] + P + offs_r[None, :], mask=r_ok[None, :], other=0.0)")
        if has_prev:
            w.comment("continue the online softmax from the previous chunks: the LSE merge, exactly")
            w.line("lse_prev = tl.load(lse_ptr + row, mask=m_ok, other=float('-inf'))")
            w.line(f"m_i = lse_prev * {fnum(LOG2E)}")
            w.line("l_i = tl.where(m_i == float('-inf'), 0.0, 1.0)")
            w.line("acc = tl.load(o_ptr + row[:, None] * V + offs_v[None, :], "
                   "mask=m_ok[:, None] & v_ok[None, :], other=0.0)")
        else:
            w.line("m_i = tl.full((BLOCK_M,), float('-inf'), dtype=tl.float32)")
            w.line("l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)")
            w.line("acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)")
        w.line("lo = ks * ks_len")
        w.line("hi = tl.minimum(tl.minimum(TK, lo + ks_len), pid_m * BLOCK_M + BLOCK_M + shift)  # causal bound")
        w.line("for n0 in range(lo, hi, BLOCK_N):")
        with w.indent():
            w.line("kn = n0 + offs_n")
            w.line("k_ok = kn < TK")
            w.line("kr_ = (b * TK + tl.where(k_ok, kn, 0).to(tl.int64))")
            w.line("k = tl.load(k_ptr + (kr_ * NH + h)[:, None] * P + offs_p[None, :], mask=p_ok[None, :], other=0.0)")
            w.line("kp = tl.load(kpe_ptr + b * kpe_bstride + tl.where(k_ok, kn, 0).to(tl.int64)[:, None] * "
                   "kpe_rstride + offs_r[None, :], mask=r_ok[None, :], other=0.0)")
            w.line(f"s = tl.dot(qn{up}, tl.trans(k{up}){dot_kw})")
            w.line(f"s = tl.dot(qr{up}, tl.trans(kp{up}), s{dot_kw})")
            w.line("ok = (kn[None, :] <= offs_m[:, None] + shift) & k_ok[None, :]")
            w.line(f"s = tl.where(ok, s * {fnum(scale * LOG2E)}, float('-inf'))")
            w.line("m_new = tl.maximum(m_i, tl.max(s, axis=1))")
            w.line("m_use = tl.where(m_new == float('-inf'), 0.0, m_new)")
            w.line("alpha = tl.exp2(m_i - m_use)")
            w.line("p = tl.exp2(s - m_use[:, None])")
            w.line("l_i = l_i * alpha + tl.sum(p, axis=1)")
            w.line("v = tl.load(v_ptr + (kr_ * NH + h)[:, None] * V + offs_v[None, :], mask=v_ok[None, :], other=0.0)")
            w.line(f"acc = tl.dot({p_cast}, v{up}, acc * alpha[:, None]{dot_kw})")
            w.line("m_i = m_new")
        _emit_normalise(w)
        w.line("orow = ks.to(tl.int64) * (B * TQ * NH) + row  # split ks writes partial ks (KS = 1: the output)")
        w.line("tl.store(o_ptr + orow[:, None] * V + offs_v[None, :], o, mask=m_ok[:, None] & v_ok[None, :])")
        w.line("tl.store(lse_ptr + orow, lse, mask=m_ok)")
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("cdiv(TQ, BLOCK_M)", "NH", "B * KS"), num_warps=plan.num_warps,
                        num_stages=plan.num_stages, ir_op=ir_op, loc=loc)


__all__ = ["emit_mla_latent_write", "emit_mla_latent_partial", "emit_mla_latent_reduce", "latent_split_plan",
           "LATENT_SPLIT_MAX_ROWS", "emit_mla_decode", "emit_mla_merge", "emit_mla_prefill", "decode_plan", "DecodePlan",
           "prefill_plan"]


# -- shape-dependent choices the runtime makes and the AOT catalogue enumerates ---------------------------------------
def decode_merge_block(rows: int, width: int, sms: int) -> int | None:
    """BLOCK_D of the decode's LSE merge for `rows` output rows on a device of `sms` SMs: whole rows (None) when the
    rows alone fill the GPU twice, else 64 or 128 columns a program (more programs for small batches)."""
    bd = width if rows >= 2 * sms else max(16, min(width, 64 if rows * (-(-width // 64)) <= 4 * sms else 128))
    return pow2_ceil(bd) if bd < width else None


def decode_merge_blocks(width: int) -> list[int | None]:
    """Every BLOCK_D decode_merge_block can answer for `width`, whatever the device's SM count."""
    out = [None]
    for bd in (64, 128):
        b = max(16, min(width, bd))
        if b < width and pow2_ceil(b) not in out:
            out.append(pow2_ceil(b))
    return out


def plan_classes(plan_fn, values) -> list[int]:
    """One representative of `values` per distinct plan_fn(value): the shape classes of a plan rule."""
    reps: dict = {}
    for v in values:
        reps.setdefault(plan_fn(v), v)
    return list(reps.values())


# token counts (and rows) that reach every branch of the MLA plan rules: each value up to 4096, then powers of two
TOKEN_CLASSES = tuple(range(1, 4097)) + tuple(2 ** i for i in range(13, 21))
