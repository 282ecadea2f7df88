"""MLA MQA decode on the Hopper tier (sm_90a): a Gluon kernel with TMA page loads, mbarriers and warpgroup MMA.

Same contract as the portable `emit_mla_decode` (mla.py): the runtime signature, the split-KV partial outputs
(o fp32 [S, B, ROWS, L] normalised, lse fp32 [S, B, ROWS] natural log, -inf and o = 0 for a split that saw no key)
and the grid (cdiv(ROWS, BLOCK_H), S, B), so the portable merge kernel combines them and the runtime can swap the
two by plan alone.

Design (after FlashMLA's SM90 dense decode, deepseek-ai/FlashMLA csrc/sm90/decode/dense/, written anew):
- one program = 64 query rows (tokens x heads, padded and masked) x one KV split of one sequence; 8 warps = two
  warpgroups;
- the 64 x (L+R) query tile sits in shared memory for the whole split (loaded once, 128-byte swizzled, in 64-column
  pieces);
- each page (PS = 64 keys = one key block) arrives by TMA as (L+R)/64 pieces of 64 x 64, each on its own mbarrier,
  into one of two page buffers: the loads of page j+1 run while page j is computed, and the score MMA of piece i
  starts as soon as piece i has landed; the pool is addressed through a device-side tensor descriptor over its rows
  (pool row = page * PS + slot; the block table gives the page);
- scores S = Q K^T by warpgroup MMA over the whole L+R reduction, the two warpgroups taking 32 keys each
  (NVMMA layout warps [4, 2]); online softmax in the log2 domain (scale * log2 e baked in);
- P goes to shared memory as bf16 and O += P V is one warpgroup MMA with warps [4, 2] and instruction N = 256: each
  warpgroup owns 256 of the 512 value columns, so the 64 x 512 fp32 accumulator is 128 registers a thread; V is the
  first L columns of the same page buffer (keys = values);
- the last page of a sequence may hold anything past its end (NaN too): its dead value rows are zeroed in shared
  memory before the P V product (0 * NaN would poison the row), and dead keys are masked to -inf like the causal
  band of a multi-token query.
"""
from __future__ import annotations

from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part
from .common import check_dim, check_float
from .mla_common import LATENT_FP8, LOG2E, _check_scale, latent_row_width

BLOCK_H = 64            # query rows per program: the wgmma M of one warpgroup (4 warps x 16 rows)
PIECE = 64              # columns per TMA piece: 64 bf16 = one 128-byte swizzle row
NUM_WARPS = 8           # two warpgroups
HOPPER_ARCH = "sm_90"   # Target.arch of the chips this tier serves (compiled for sm_90a)


def hopper_decode_supported(kv_lora_rank: int, rope_dim: int, page_size: int, dtype: str,
                            cache_dtype: str | None, target: Target) -> bool:
    """Whether this kernel serves the shape: an sm_90 target, bf16 / fp16 queries over a cache of the same dtype,
    pages of 64 keys, L 256 or 512 (two warpgroups x one N <= 256 MMA), R 64 or 128 (power-of-two tiles)."""
    return (target.arch == HOPPER_ARCH and target.backend == "cuda" and page_size == 64
            and dtype in ("bf16", "fp16") and (cache_dtype or dtype) == dtype
            and kv_lora_rank in (256, 512) and rope_dim in (64, 128))


def emit_mla_decode_hopper(kv_lora_rank: int, rope_dim: int, page_size: int, scale: float, *, target: Target,
                           dtype: str = "bf16", cache_dtype: str | None = None, name: str | None = None,
                           ir_op: str = "mla_absorbed", loc: str = "") -> KernelSource:
    """Kernel args: q_ptr [B, ROWS, L+R] (rows token-major (t, head)), pool_ptr (latent rows [pages * PS, L+R]),
    bt_ptr i32 [B, max_pages], lens_ptr i32 [B] (total tokens incl. the new ones), o_ptr fp32 [S, B, ROWS, L],
    lse_ptr fp32 [S, B, ROWS], ROWS, NH, TQ, max_pages, pages_per_split, B, S; grid (cdiv(ROWS, 64), S, B)."""
    L, R, PS = check_dim(kv_lora_rank, "kv_lora_rank"), check_dim(rope_dim, "rope"), check_dim(page_size, "page")
    dt = check_float(dtype)
    cdt = cache_dtype or dt
    if cdt == LATENT_FP8:
        raise CodegenError("hopper decode: the fp8 latent cache is not on the Hopper tier yet (portable tier)")
    if not hopper_decode_supported(L, R, PS, dt, cdt, target):
        raise CodegenError(f"hopper decode: needs an sm_90 cuda target, {dt} == cache dtype in (bf16, fp16), "
                           f"page size 64, L in (256, 512), R in (64, 128); got {target.name} "
                           f"({target.backend} {target.arch}) L={L} R={R} PS={PS} {dt} cache:{cdt}")
    _check_scale(scale)
    gdt = {"bf16": "gl.bfloat16", "fp16": "gl.float16"}[dt]
    kname = ident(name or f"k3c_mla_decode_hopper_l{L}_r{R}_p{PS}_{name_part(dt)}")
    sig = {"q_ptr": f"*{dt}", "pool_ptr": f"*{dt}", "bt_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*fp32",
           "lse_ptr": "*fp32", "ROWS": "i32", "NH": "i32", "TQ": "i32", "max_pages": "i32",
           "pages_per_split": "i32", "B": "i32", "S": "i32"}
    W = latent_row_width(L, R, cdt)
    cx = {"L": L, "R": R, "PS": PS, "BLOCK_H": BLOCK_H, "W": W, "NPIECE": W // PIECE, "NVAL": L // PIECE}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"mla MQA split-KV decode, Hopper tier (Gluon, sm_90a): L={L} R={R} PS={PS} "
                    f"scale={fnum(scale)} {dt}", f"BLOCK_H={BLOCK_H} num_warps={NUM_WARPS} TMA pieces of {PIECE}"])
    w.line("from triton.experimental import gluon")
    w.line("from triton.experimental.gluon import language as gl")
    w.line("from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, "
           "warpgroup_mma, warpgroup_mma_wait")
    w.blank()
    w.blank()
    w.line("@gluon.jit")
    w.line(f"def {kname}(")
    with w.indent(2):
        for a in sig:
            w.line(ident(a) + ",")
        for c in cx:
            w.line(f"{ident(c)}: gl.constexpr,")
    w.line("):")
    with w.indent():
        _emit_body(w, gdt, scale)
    w.blank()
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("cdiv(ROWS, BLOCK_H)", "S", "B"), num_warps=NUM_WARPS, num_stages=1,
                        ir_op=ir_op, loc=loc)


def _emit_body(w: SourceWriter, gdt: str, scale: float) -> None:
    ln = w.line
    w.comment("layouts: scores [64, 64] and output [64, L] as warpgroup-MMA accumulators with warps [4, 2] (the two "
              "warpgroups split the keys of S and the value columns of O); 128-byte swizzled tiles")
    ln("S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], "
       "instr_shape=[16, PS // 2, 16])")
    ln("O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], "
       "instr_shape=[16, L // 2, 16])")
    ln("SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)")
    ln("LD: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])")
    ln("ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)")
    ln("COL_S: gl.constexpr = gl.SliceLayout(0, S_L)")
    ln("ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)")
    ln("COL_O: gl.constexpr = gl.SliceLayout(0, O_L)")
    ln("pid_h = gl.program_id(0)")
    ln("split = gl.program_id(1)")
    ln("b = gl.program_id(2).to(gl.int64)")
    ln("seq_len = gl.load(lens_ptr + b)")
    ln("n_pages = gl.cdiv(seq_len, PS)")
    ln("p_begin = split * pages_per_split")
    ln("p_end = gl.minimum(p_begin + pages_per_split, n_pages)")
    ln("bt_row = bt_ptr + b * max_pages")
    w.blank()
    w.comment("shared memory: the query tile, two page buffers, P; one barrier per (buffer, piece)")
    ln(f"q_lat = gl.allocate_shared_memory({gdt}, [BLOCK_H, L], SW)")
    ln(f"q_pe = gl.allocate_shared_memory({gdt}, [BLOCK_H, R], SW)")
    ln(f"kv_lat = gl.allocate_shared_memory({gdt}, [2, PS, L], SW)  # keys = values")
    ln(f"kv_pe = gl.allocate_shared_memory({gdt}, [2, PS, R], SW)")
    ln(f"p_smem = gl.allocate_shared_memory({gdt}, [BLOCK_H, PS], SW)")
    ln("bars = gl.allocate_shared_memory(gl.int64, [2 * NPIECE, 1], mbarrier.MBarrierLayout())")
    ln("for i in gl.static_range(2 * NPIECE):")
    with w.indent():
        ln("mbarrier.init(bars.index(i), count=1)")
    w.comment("the pool as rows [pages * PS, W]; its extent is unknown here and never exceeded (pages come from the "
              "block table), so the descriptor claims the largest i32 row count")
    ln("desc = tma.make_tensor_descriptor(pool_ptr, shape=[2147483647, W], strides=[W, 1], "
       "block_shape=[PS, 64], layout=SW)")
    w.blank()
    w.comment("the query tile (rows past ROWS are zeros) into shared memory, once")
    ln("lrows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))")
    ln("lcols = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))")
    ln("q_base = q_ptr + (b * ROWS + gl.where(lrows < ROWS, lrows, 0).to(gl.int64)) * W")
    ln("for i in gl.static_range(NPIECE):")
    with w.indent():
        ln("qt = gl.load(q_base[:, None] + (i * 64 + lcols)[None, :], mask=(lrows < ROWS)[:, None], other=0.0)")
        ln("if i < NVAL:")
        with w.indent():
            ln("q_lat.slice(i * 64, 64, dim=1).store(qt)")
        ln("else:")
        with w.indent():
            ln("q_pe.slice((i - NVAL) * 64, 64, dim=1).store(qt)")
    ln("fence_async_shared()")
    ln("gl.barrier()")
    w.blank()
    w.comment("first page's pieces")
    ln("if p_begin < p_end:")
    with w.indent():
        ln("page0 = gl.load(bt_row + p_begin)")
        _emit_page_load(w, "page0", "0")
    w.blank()
    ln("rows_s = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)")
    ln("qpos = seq_len - TQ + rows_s // NH  # each row's query position (causal limit)")
    ln("keys = gl.arange(0, PS, layout=COL_S)")
    ln("m_i = gl.full([BLOCK_H], float('-inf'), gl.float32, layout=ROW_S)")
    ln("l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW_S)")
    ln("acc = gl.zeros([BLOCK_H, L], gl.float32, layout=O_L)")
    ln("for p in range(p_begin, p_end):")
    with w.indent():
        ln("it = p - p_begin")
        ln("buf = it % 2")
        ln("phase = (it // 2) % 2")
        ln("kvl = kv_lat.index(buf)")
        ln("kvr = kv_pe.index(buf)")
        w.comment("next page's pieces into the other buffer (every warp finished reading it: barrier at the end of "
                  "the last step)")
        ln("if p + 1 < p_end:")
        with w.indent():
            ln("page_n = gl.load(bt_row + p + 1)")
            _emit_page_load(w, "page_n", "1 - buf")
        w.comment("S = Q K^T, piece by piece as each lands")
        ln("s = gl.zeros([BLOCK_H, PS], gl.float32, layout=S_L)")
        ln("for i in gl.static_range(NPIECE):")
        with w.indent():
            ln("mbarrier.wait(bars.index(buf * NPIECE + i), phase)")
            ln("if i < NVAL:")
            with w.indent():
                ln("s = warpgroup_mma(q_lat.slice(i * 64, 64, dim=1), kvl.slice(i * 64, 64, dim=1).permute((1, 0)), "
                   "s, is_async=True)")
            ln("else:")
            with w.indent():
                ln("s = warpgroup_mma(q_pe.slice((i - NVAL) * 64, 64, dim=1), "
                   "kvr.slice((i - NVAL) * 64, 64, dim=1).permute((1, 0)), s, is_async=True)")
        ln("s = warpgroup_mma_wait(num_outstanding=0, deps=[s])")
        ln("kpos = p * PS + keys")
        ln("ok = (kpos[None, :] <= qpos[:, None]) & (kpos < seq_len)[None, :]")
        ln(f"s = gl.where(ok, s * {fnum(scale * LOG2E)}, float('-inf'))  # log2 domain")
        ln("m_new = gl.maximum(m_i, gl.max(s, axis=1))")
        ln("m_use = gl.where(m_new == float('-inf'), 0.0, m_new)")
        ln("alpha = gl.exp2(m_i - m_use)")
        ln("pr = gl.exp2(s - m_use[:, None])")
        ln("l_i = l_i * alpha + gl.sum(pr, axis=1)")
        ln("m_i = m_new")
        ln("acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]")
        ln(f"p_smem.store(pr.to({gdt}))")
        ln("if (p + 1) * PS > seq_len:")
        with w.indent():
            w.comment("the sequence's last page: value rows past its end may hold NaN (0 * NaN = NaN): zero them")
            ln("dead = (p * PS + gl.arange(0, PS, layout=gl.SliceLayout(1, LD))) >= seq_len")
            ln("for i in gl.static_range(NVAL):")
            with w.indent():
                ln("vp = kvl.slice(i * 64, 64, dim=1)")
                ln("vt = vp.load(LD)")
                ln("vp.store(gl.where(dead[:, None], gl.zeros_like(vt), vt))")
        ln("fence_async_shared()")
        ln("gl.barrier()")
        ln("acc = warpgroup_mma(p_smem, kvl, acc, is_async=True)")
        ln("acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])")
        ln("gl.barrier()")
    w.blank()
    ln("for i in gl.static_range(2 * NPIECE):")
    with w.indent():
        ln("mbarrier.invalidate(bars.index(i))")
    w.comment("o = acc / l and its natural-log LSE (rows that saw no key: o = 0, lse = -inf)")
    ln("has = l_i > 0.0")
    ln(f"lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * {fnum(1.0 / LOG2E)}, float('-inf'))")
    ln("inv = gl.convert_layout(gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0), ROW_O)")
    ln("o = acc * inv[:, None]")
    ln("rows_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)")
    ln("cols_o = gl.arange(0, L, layout=COL_O)")
    ln("row_ok = rows_o < ROWS")
    ln("out_row = (split.to(gl.int64) * B + b) * ROWS + gl.where(row_ok, rows_o, 0).to(gl.int64)")
    ln("gl.store(o_ptr + out_row[:, None] * L + cols_o[None, :], o, mask=row_ok[:, None])")
    ln("rows_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)")
    ln("out_l = (split.to(gl.int64) * B + b) * ROWS + gl.where(rows_l < ROWS, rows_l, 0).to(gl.int64)")
    ln("gl.store(lse_ptr + out_l, lse, mask=rows_l < ROWS)")


def _emit_page_load(w: SourceWriter, page: str, buf: str) -> None:
    """TMA of one page's NPIECE pieces of 64 columns into page buffer `buf`, each piece on its own barrier."""
    w.line(f"nb = {buf}")
    w.line("for i in gl.static_range(NPIECE):")
    with w.indent():
        w.line("mbarrier.expect(bars.index(nb * NPIECE + i), PS * 64 * 2)")
        w.line("if i < NVAL:")
        with w.indent():
            w.line(f"tma.async_load(desc, [{page} * PS, i * 64], bars.index(nb * NPIECE + i), "
                   "kv_lat.index(nb).slice(i * 64, 64, dim=1))")
        w.line("else:")
        with w.indent():
            w.line(f"tma.async_load(desc, [{page} * PS, i * 64], bars.index(nb * NPIECE + i), "
                   "kv_pe.index(nb).slice((i - NVAL) * 64, 64, dim=1))")
