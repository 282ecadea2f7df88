"""MLA MQA decode on the Hopper tier (sm_90a): Gluon kernels with TMA page loads, mbarriers and warpgroup MMA.

Same contract as the portable `emit_mla_decode` (mla.py): the runtime signature, the split-KV partial outputs
(o fp32 [S, B, ROWS, L] normalised, lse fp32 [S, B, ROWS] natural log, -inf and o = 0 for a split that saw no key)
and the grid (cdiv(ROWS, BLOCK_H), S, B), so the portable merge kernel combines them and the runtime can swap the
two by plan alone.

Common design (after FlashMLA's SM90 dense decode, deepseek-ai/FlashMLA csrc/sm90/decode/dense/, written anew):
- one program = 64 query rows (tokens x heads, padded and masked) x one KV split of one sequence, two warpgroups;
- the 64 x (L+R) query tile sits in shared memory for the whole split (loaded once, 128-byte swizzled);
- each page (PS = 64 keys = one key block) arrives by TMA in (L+R)/64 pieces of 64 x 64 into one of two page
  buffers (2 x 72 KB + the 72 KB query tile: what fits in 227 KB), the pool addressed through a device-side tensor
  descriptor over its rows (pool row = page * PS + slot; the block table gives the page);
- online softmax in the log2 domain (scale * log2 e baked in); O (64 x 512 fp32) split by value columns, each
  warpgroup owning 256 (128 registers a thread), O += P V one warpgroup MMA of N = 256 per warpgroup, V being the
  first L columns of the same page buffer (keys = values);
- slots past a sequence's end may hold anything, NaN too (0 * NaN would poison P V): they are zeroed (lockstep) or
  zero-filled by TMA (seesaw) before the P V product and masked to -inf like the causal band of a multi-token query.

Schedules (`schedule`):
- "seesaw" (shipped): FlashMLA's schedule, warp-specialised (gl.warp_specialize) into two warpgroup partitions of
  256 registers a thread; block t of the split belongs to warpgroup t % 2 (its full 64 x 64 scores and softmax);
  the running max and rescale factor pass to the other warpgroup through shared memory, P_t goes into the dead rope
  piece of its buffer, and both warpgroups multiply every block's P by their half of V, the other's block (async)
  overlapping their own softmax. Each page arrives in three parts on their own barriers (value half 0, value half 1,
  rope): a warpgroup reloads its half of a buffer as soon as its own P V of that buffer is done, the rope piece
  once both are (it holds P); the owner's scores start with the half it loaded itself. The last page of a sequence
  comes through a second descriptor over its live rows only, so the copy engine zero-fills the slots past the end.
  255 registers, no stack: the page loop holds only own blocks (the other warpgroup's last block after it), the first
  score MMA reads no accumulator, and the 2 x 36 score operand descriptors are rebuilt in the loop (an opaque zero
  index; hoisted out of it they took 144 registers and spilled). The output is staged in the dead page buffers
  (fp32) and stored coalesced after the partitions join.
- "lockstep": 8 warps run one program text (NVMMA layouts with warps [4, 2]): each page's 9 pieces on their own
  barriers, S = Q K^T with the warpgroups taking 32 keys each (the score MMA of piece i starts when it has landed),
  a cross-warpgroup softmax, P through shared memory, then P V; the next page's TMA runs during the current page.
  225 registers, no spills; 14-16% slower than the seesaw at 96 heads from batch 32 up (bench/mla_hopper.py).
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
LOCKSTEP, SEESAW = "lockstep", "seesaw"
SCHEDULES = (SEESAW, LOCKSTEP)          # the first is shipped (see the module doc)
WG_REGS = 256           # registers per thread of each warpgroup partition (setmaxnreg): 2 x 128 threads x 256 = the
                        # whole register file of an SM; one program per SM (its shared memory says so too)
HOPPER_ARCH = "sm_90"   # Target.arch of the chips this tier serves (compiled for sm_90a)
SHARED_SLACK = 8192     # shared memory past the query tile and page buffers: P (lockstep), barriers, row stats


def hopper_decode_supported(kv_lora_rank: int, rope_dim: int, page_size: int, dtype: str,
                            cache_dtype: str | None, target: Target) -> bool:
    """Whether this kernel serves the shape: an sm_90 target, bf16 / fp16 queries over a cache of the same dtype,
    pages of 64 keys, L 256 or 512 (two warpgroups x one N <= 256 MMA), R 64 or 128 (power-of-two tiles), and the
    query tile with two page buffers in shared memory (L 512 with R 128 is 240 KB: more than an SM holds)."""
    return (target.arch == HOPPER_ARCH and target.backend == "cuda" and page_size == 64
            and dtype in ("bf16", "fp16") and (cache_dtype or dtype) == dtype
            and kv_lora_rank in (256, 512) and rope_dim in (64, 128)
            and 3 * BLOCK_H * (kv_lora_rank + rope_dim) * 2 + SHARED_SLACK <= target.shared_mem_bytes)


def emit_mla_decode_hopper(kv_lora_rank: int, rope_dim: int, page_size: int, scale: float, *, target: Target,
                           dtype: str = "bf16", cache_dtype: str | None = None, name: str | None = None,
                           ir_op: str = "mla_absorbed", loc: str = "", schedule: str = SEESAW) -> KernelSource:
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
                           f"page size 64, L in (256, 512), R in (64, 128), L + R <= 576 (shared memory); got {target.name} "
                           f"({target.backend} {target.arch}) L={L} R={R} PS={PS} {dt} cache:{cdt}")
    _check_scale(scale)
    if schedule not in SCHEDULES:
        raise CodegenError(f"hopper decode: schedule must be one of {SCHEDULES}, got {schedule!r}")
    gdt = {"bf16": "gl.bfloat16", "fp16": "gl.float16"}[dt]
    kname = ident(name or f"k3c_mla_decode_hopper_l{L}_r{R}_p{PS}_{name_part(dt)}"
                  + ("" if schedule == LOCKSTEP else f"_{schedule}"))
    sig = {"q_ptr": f"*{dt}", "pool_ptr": f"*{dt}", "bt_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*fp32",
           "lse_ptr": "*fp32", "ROWS": "i32", "NH": "i32", "TQ": "i32", "max_pages": "i32",
           "pages_per_split": "i32", "B": "i32", "S": "i32"}
    W = latent_row_width(L, R, cdt)
    cx = {"L": L, "R": R, "PS": PS, "BLOCK_H": BLOCK_H, "W": W, "NPIECE": W // PIECE, "NVAL": L // PIECE}
    if schedule == SEESAW:
        return _seesaw(kname, sig, cx, gdt, scale, target, ir_op, loc)
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"mla MQA split-KV decode, Hopper tier (Gluon, sm_90a): L={L} R={R} PS={PS} "
                    f"scale={fnum(scale)} {dt}", f"BLOCK_H={BLOCK_H} num_warps={NUM_WARPS} TMA pieces of {PIECE}"])
    w.gluon_imports("from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, "
                    "tma, warpgroup_mma, warpgroup_mma_wait")
    with w.gluon_function(kname, sig, cx):
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
    _emit_shared_and_query(w, gdt)
    _emit_page_loop(w, gdt, scale)
    _emit_epilogue(w)


def _emit_shared_and_query(w: SourceWriter, gdt: str) -> None:
    """Shared memory, barriers and the pool's descriptor; the query tile; the first page's loads."""
    ln = w.line
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


def _emit_page_loop(w: SourceWriter, gdt: str, scale: float) -> None:
    """The online softmax over the split's pages: the next page loads while this one is scored and multiplied."""
    ln = w.line
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


def _emit_epilogue(w: SourceWriter) -> None:
    """Barriers released; the normalised partial and its natural-log LSE stored."""
    ln = w.line
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


def _seesaw(kname: str, sig: dict, cx: dict, gdt: str, scale: float, target: Target, ir_op: str, loc: str
            ) -> KernelSource:
    """The seesaw schedule: two warp-specialised warpgroups, see SEESAW_SOURCE."""
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"mla MQA split-KV decode, Hopper tier (Gluon, sm_90a), seesaw schedule: L={cx['L']} "
                    f"R={cx['R']} PS={cx['PS']} scale={fnum(scale)}",
                    f"BLOCK_H={BLOCK_H}: 2 warpgroups (warp_specialize), TMA pieces of {PIECE}"])
    w.line("from triton.experimental import gluon")
    w.line("from triton.experimental.gluon import language as gl")
    w.line("from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, "
           "warpgroup_mma, warpgroup_mma_wait")
    subst = {"{KNAME}": ident(kname), "{GDT}": gdt, "{SCALE_LOG2}": fnum(scale * LOG2E),
             "{INV_LOG2E}": fnum(1.0 / LOG2E), "{REGS1}": str(int(WG_REGS))}
    text = SEESAW_SOURCE
    for k, v in subst.items():
        text = text.replace(k, v)
    w.lines(text.split("\n"))
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=cx,
                        grid=("cdiv(ROWS, BLOCK_H)", "S", "B"), num_warps=4, num_stages=1, ir_op=ir_op, loc=loc)


# The seesaw kernel (after FlashMLA's schedule of the same name, written for Gluon; see the module doc). Block t of
# the split belongs to warpgroup t % 2, which computes its scores and softmax; every block's P V is split by value
# columns (each warpgroup owns 256 of the 512 output columns, 128 fp32 registers a thread). While one warpgroup runs
# its softmax, its P V of the other's previous block keeps the tensor cores busy. The running max passes from one
# warpgroup's softmax to the next through shared memory (m_buf / sc_buf, barrier sm_bar), so both rescale their
# halves of O by the same factors; P_t is written into the rope piece of block t's buffer (dead once its scores are
# done). Placeholders: {KNAME} {GDT} {SCALE_LOG2} {INV_LOG2E} {REGS1}, replaced by checked names and numbers only.
SEESAW_SOURCE = """
@gluon.jit
def _load_part(desc, tail, bt_split, n_full, kv_lat, kv_pe, ready, u, part: gl.constexpr):
    # part of page u of the split into buffer u % 2 on barrier ready[u % 2, part]: part 0 / 1 = value half 0 / 1
    # (L / 128 pieces of 64 columns), part 2 = the rope pieces. The sequence's partial last page comes through
    # `tail`, a descriptor over its live rows only: the copy engine zero-fills the rest (NaN may live there)
    PS: gl.constexpr = kv_lat.shape[1]
    bar = ready.index((u % 2) * 3 + part)
    if part < 2:
        mbarrier.expect(bar, PS * kv_lat.shape[2] * 2 // 2)
    else:
        mbarrier.expect(bar, PS * kv_pe.shape[2] * 2)
    if u < n_full:
        _copy_part(desc, gl.load(bt_split + u) * PS, bar, kv_lat, kv_pe, u % 2, part)
    else:
        _copy_part(tail, 0, bar, kv_lat, kv_pe, u % 2, part)


@gluon.jit
def _copy_part(d, row, bar, kv_lat, kv_pe, b, part: gl.constexpr):
    NH2: gl.constexpr = kv_lat.shape[2] // 128
    if part < 2:
        for i in gl.static_range(part * NH2, (part + 1) * NH2):
            tma.async_load(d, [row, i * 64], bar, kv_lat.index(b).slice(i * 64, 64, dim=1))
    else:
        for i in gl.static_range(kv_pe.shape[2] // 64):
            tma.async_load(d, [row, kv_lat.shape[2] + i * 64], bar, kv_pe.index(b).slice(i * 64, 64, dim=1))


@gluon.jit
def _scores(q_lat, q_pe, kv_lat, kv_pe, ready, t, W: gl.constexpr, S_L: gl.constexpr):
    # S = Q K_t^T over the whole L + R reduction: this warpgroup's value half first (it loaded it itself, first),
    # then the other half, then the rope, each as soon as it has landed. z (always 0, opaque to the compiler) keeps
    # the 2 x 36 operand descriptors from being hoisted out of the page loop into registers (they would spill)
    BLOCK_H: gl.constexpr = q_lat.shape[1]
    PS: gl.constexpr = kv_lat.shape[1]
    NH2: gl.constexpr = kv_lat.shape[2] // 128
    NR: gl.constexpr = kv_pe.shape[2] // 64
    z = t >> 30
    b = t % 2 + z
    ph = (t // 2) % 2
    ql = q_lat.index(z)
    qp = q_pe.index(z)
    kl = kv_lat.index(b)
    kp = kv_pe.index(b)
    s = gl.zeros([BLOCK_H, PS], gl.float32, layout=S_L)
    for h in gl.static_range(2):
        mbarrier.wait(ready.index(b * 3 + (W + h) % 2), ph)
        for i in gl.static_range(NH2):
            s = warpgroup_mma(ql.slice((((W + h) % 2) * NH2 + i) * 64, 64, dim=1),
                              kl.slice((((W + h) % 2) * NH2 + i) * 64, 64, dim=1).permute((1, 0)), s,
                              use_acc=(h + i) > 0, is_async=True)
    mbarrier.wait(ready.index(b * 3 + 2), ph)
    for i in gl.static_range(NR):
        s = warpgroup_mma(qp.slice(i * 64, 64, dim=1), kp.slice(i * 64, 64, dim=1).permute((1, 0)), s,
                          is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=[s])


@gluon.jit
def _softmax(s, kv_pe, m_buf, sc_buf, sm_bar, t, qrel, m_run, S_L: gl.constexpr):
    # block t's probabilities against the running max m_run (the max after block t - 1): P_t into the dead rope
    # piece of its buffer (its first PS columns), its max and rescale factor into shared memory, then the other
    # warpgroup is told.
    # qrel: each row's query position relative to the split's first key; keys past it are masked (qpos <= seq_len
    # - 1, so this also hides the slots past the sequence's end)
    PS: gl.constexpr = kv_pe.shape[1]
    b = t % 2
    keys = gl.arange(0, PS, layout=gl.SliceLayout(0, S_L))
    s = gl.where(keys[None, :] <= (qrel - t * PS)[:, None], s * {SCALE_LOG2}, float('-inf'))  # log2 domain
    m_new = gl.maximum(m_run, gl.max(s, axis=1))
    m_use = gl.where(m_new == float('-inf'), 0.0, m_new)
    sc = gl.exp2(m_run - m_use)
    pr = gl.exp2(s - m_use[:, None])
    kv_pe.index(b).slice(0, PS, dim=1).store(pr.to(kv_pe.dtype))
    m_buf.index(b).store(m_new)
    sc_buf.index(b).store(sc)
    fence_async_shared()
    gl.barrier()
    mbarrier.arrive(sm_bar.index(b))
    return gl.sum(pr, axis=1), sc, m_new


@gluon.jit
def _warpgroup(W: gl.constexpr, q_lat, q_pe, kv_lat, kv_pe, ready, free, sm_bar, m_buf, sc_buf, l_buf, l_bar, stats,
               desc, tail, bt_split, n_full, n_blocks, qrel0, rows0, NH):
    BLOCK_H: gl.constexpr = q_lat.shape[1]
    L: gl.constexpr = q_lat.shape[2]
    PS: gl.constexpr = kv_lat.shape[1]
    # warpgroup W: the softmax of blocks t = W, W + 2, ... (seesaw: the two warpgroups' softmaxes alternate) and,
    # for every block, O[:, W * L/2 : (W + 1) * L/2] += P_t V_t of its half of the value columns. Once its P V of a
    # block is done, its half of that buffer is dead: it loads its half of the block two ahead there at once; the
    # rope piece (which holds P) waits for both warpgroups (`free`) and is loaded by the next block's other owner
    HALF: gl.constexpr = L // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PS, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    qrel = qrel0 + (rows0 + gl.arange(0, BLOCK_H, layout=ROW_S)) // NH
    m_run = gl.full([BLOCK_H], float('-inf'), gl.float32, layout=ROW_S)
    l_w = gl.zeros([BLOCK_H], gl.float32, layout=ROW_S)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=O_L)
    if W == 0:
        if n_blocks > 0:
            s = _scores(q_lat, q_pe, kv_lat, kv_pe, ready, 0, W, S_L)
            l_w, sc, m_run = _softmax(s, kv_pe, m_buf, sc_buf, sm_bar, 0, qrel, m_run, S_L)
            acc = warpgroup_mma(kv_pe.index(0).slice(0, PS, dim=1), kv_lat.index(0).slice(W * HALF, HALF, dim=1), acc)
            if n_blocks > 2:
                _load_part(desc, tail, bt_split, n_full, kv_lat, kv_pe, ready, 2, W)
            mbarrier.arrive(free.index(0))
    # own blocks t >= 1; each step also does the other warpgroup's block t - 1
    for t in range(2 - W, n_blocks, 2):
        b = t % 2
        ob = 1 - b
        s = _scores(q_lat, q_pe, kv_lat, kv_pe, ready, t, W, S_L)
        # the other warpgroup's block t - 1: its rescale factor and max, then P V of this half (async)
        mbarrier.wait(sm_bar.index(ob), ((t - 1) // 2) % 2)
        sc_o = sc_buf.index(ob).load(ROW_S)
        m_run = m_buf.index(ob).load(ROW_S)
        acc = acc * gl.convert_layout(sc_o, ROW_O)[:, None]
        acc = warpgroup_mma(kv_pe.index(ob).slice(0, PS, dim=1), kv_lat.index(ob).slice(W * HALF, HALF, dim=1), acc,
                            is_async=True)
        l_t, sc, m_run = _softmax(s, kv_pe, m_buf, sc_buf, sm_bar, t, qrel, m_run, S_L)
        l_w = (l_w * sc_o) * sc + l_t
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        if t + 1 < n_blocks:
            _load_part(desc, tail, bt_split, n_full, kv_lat, kv_pe, ready, t + 1, W)
        mbarrier.arrive(free.index(ob))
        if t + 1 < n_blocks:
            # block t + 1's rope piece into the buffer of block t - 1 once both are done with P_{t-1}
            mbarrier.wait(free.index(ob), ((t - 1) // 2) % 2)
            _load_part(desc, tail, bt_split, n_full, kv_lat, kv_pe, ready, t + 1, 2)
        acc = acc * gl.convert_layout(sc, ROW_O)[:, None]
        acc = warpgroup_mma(kv_pe.index(b).slice(0, PS, dim=1), kv_lat.index(b).slice(W * HALF, HALF, dim=1), acc)
        if t + 2 < n_blocks:
            _load_part(desc, tail, bt_split, n_full, kv_lat, kv_pe, ready, t + 2, W)
        mbarrier.arrive(free.index(b))
    # the split's last block, when the other warpgroup owns it
    t_last = n_blocks - 1
    if (t_last >= 0) & (t_last % 2 != W):
        ob = t_last % 2
        mbarrier.wait(sm_bar.index(ob), (t_last // 2) % 2)
        sc_o = sc_buf.index(ob).load(ROW_S)
        m_run = m_buf.index(ob).load(ROW_S)
        l_w = l_w * sc_o
        acc = acc * gl.convert_layout(sc_o, ROW_O)[:, None]
        acc = warpgroup_mma(kv_pe.index(ob).slice(0, PS, dim=1), kv_lat.index(ob).slice(W * HALF, HALF, dim=1), acc)
    # the row sums of both warpgroups' blocks (same running max), then o = acc / l and the final max and sum
    l_buf.index(W).store(l_w)
    gl.barrier()
    mbarrier.arrive(l_bar)
    mbarrier.wait(l_bar, 0)
    l_i = l_w + l_buf.index(1 - W).load(ROW_S)
    has = l_i > 0.0
    inv = gl.convert_layout(gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0), ROW_O)
    # o = acc / l into the (now dead) page buffer W as fp32; the kernel's epilogue writes it out
    FLAT2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    kv_lat.index(W).reinterpret(gl.float32, [BLOCK_H, HALF], FLAT2).store(acc * inv[:, None])
    if W == 0:
        stats.index(0).store(m_run)
        stats.index(1).store(l_i)


@gluon.jit
def _warpgroup0(q_lat, q_pe, kv_lat, kv_pe, ready, free, sm_bar, m_buf, sc_buf, l_buf, l_bar, stats, desc, tail,
                bt_split, n_full, n_blocks, qrel0, rows0, NH):
    _warpgroup(0, q_lat, q_pe, kv_lat, kv_pe, ready, free, sm_bar, m_buf, sc_buf, l_buf, l_bar, stats, desc, tail,
               bt_split, n_full, n_blocks, qrel0, rows0, NH)


@gluon.jit
def _warpgroup1(q_lat, q_pe, kv_lat, kv_pe, ready, free, sm_bar, m_buf, sc_buf, l_buf, l_bar, stats, desc, tail,
                bt_split, n_full, n_blocks, qrel0, rows0, NH):
    _warpgroup(1, q_lat, q_pe, kv_lat, kv_pe, ready, free, sm_bar, m_buf, sc_buf, l_buf, l_bar, stats, desc, tail,
               bt_split, n_full, n_blocks, qrel0, rows0, NH)


@gluon.jit
def {KNAME}(q_ptr, pool_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, ROWS, NH, TQ, max_pages, pages_per_split, B, S,
        L: gl.constexpr, R: gl.constexpr, PS: gl.constexpr, BLOCK_H: gl.constexpr, W: gl.constexpr,
        NPIECE: gl.constexpr, NVAL: gl.constexpr):
    DT: gl.constexpr = {GDT}
    SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    pid_h = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    seq_len = gl.load(lens_ptr + b)
    n_pages = gl.cdiv(seq_len, PS)
    p_begin = split * pages_per_split
    n_blocks = gl.maximum(gl.minimum(p_begin + pages_per_split, n_pages) - p_begin, 0)
    rows0 = pid_h * BLOCK_H
    q_lat = gl.allocate_shared_memory(DT, [1, BLOCK_H, L], SW)
    q_pe = gl.allocate_shared_memory(DT, [1, BLOCK_H, R], SW)
    kv_lat = gl.allocate_shared_memory(DT, [2, PS, L], SW)
    kv_pe = gl.allocate_shared_memory(DT, [2, PS, R], SW)
    m_buf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], FLAT)
    sc_buf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], FLAT)
    l_buf = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], FLAT)
    stats = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], FLAT)  # final row max and row sum
    ready = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sm_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(6):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(free.index(i), count=2)
        mbarrier.init(sm_bar.index(i), count=1)
    mbarrier.init(l_bar, count=2)
    bt_row = bt_ptr + b * max_pages
    desc = tma.make_tensor_descriptor(pool_ptr, shape=[2147483647, W], strides=[W, 1], block_shape=[PS, 64],
                                      layout=SW)
    # pages before n_full are whole; the last page, when partial, is read through `tail` (zero-filled past the end)
    n_full = seq_len // PS
    last = gl.load(bt_row + gl.maximum(n_pages - 1, 0)).to(gl.int64)
    tail = tma.make_tensor_descriptor(pool_ptr + last * (PS * W), shape=[gl.maximum(seq_len - n_full * PS, 1), W],
                                      strides=[W, 1], block_shape=[PS, 64], layout=SW)
    bt_split = bt_row + p_begin
    n_full = n_full - p_begin
    for u in gl.static_range(2):
        if u < n_blocks:
            for part in gl.static_range(3):
                _load_part(desc, tail, bt_split, n_full, kv_lat, kv_pe, ready, u, part)
    lrows = rows0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    lcols = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
    q_base = q_ptr + (b * ROWS + gl.where(lrows < ROWS, lrows, 0).to(gl.int64)) * W
    for i in gl.static_range(NPIECE):
        qt = gl.load(q_base[:, None] + (i * 64 + lcols)[None, :], mask=(lrows < ROWS)[:, None], other=0.0)
        if i < NVAL:
            q_lat.index(0).slice(i * 64, 64, dim=1).store(qt)
        else:
            q_pe.index(0).slice((i - NVAL) * 64, 64, dim=1).store(qt)
    fence_async_shared()
    gl.barrier()
    args = (q_lat, q_pe, kv_lat, kv_pe, ready, free, sm_bar, m_buf, sc_buf, l_buf, l_bar, stats, desc, tail, bt_split,
            n_full, n_blocks, seq_len - TQ - p_begin * PS, rows0, NH)
    gl.warp_specialize([(_warpgroup0, args), (_warpgroup1, args)], [4], [{REGS1}])
    gl.barrier()
    # epilogue: the normalised o (fp32, in the two page buffers) and the natural-log LSE, coalesced
    FLAT2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    HALF: gl.constexpr = L // 2
    OUT: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    out_base = (split.to(gl.int64) * B + b) * ROWS
    orow = rows0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, OUT))
    ocol = gl.arange(0, 64, layout=gl.SliceLayout(0, OUT))
    o_row = o_ptr + (out_base + gl.where(orow < ROWS, orow, 0).to(gl.int64)) * L
    for i in gl.static_range(L // 64):
        half = kv_lat.index(i // (HALF // 64)).reinterpret(gl.float32, [BLOCK_H, HALF], FLAT2)
        ot = half.slice((i % (HALF // 64)) * 64, 64, dim=1).load(OUT)
        gl.store(o_row[:, None] + (i * 64 + ocol)[None, :], ot, mask=(orow < ROWS)[:, None])
    ST: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    srow = rows0 + gl.arange(0, BLOCK_H, layout=ST)
    m_fin = stats.index(0).load(ST)
    l_fin = stats.index(1).load(ST)
    has = l_fin > 0.0
    lse = gl.where(has, (m_fin + gl.log2(gl.where(has, l_fin, 1.0))) * {INV_LOG2E}, float('-inf'))
    gl.store(lse_ptr + out_base + gl.where(srow < ROWS, srow, 0).to(gl.int64), lse, mask=srow < ROWS)
"""
