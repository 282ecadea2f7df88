"""KDA state passing on the Hopper tier (sm_90a): a Gluon kernel whose state never leaves registers.

Same contract as the portable `emit_kda_inter` (kda.py): the runtime signature (the intra-chunk kernel's outputs,
v, o, s0 / sT, cu, sv, N), the outputs (o [total, H, D], the final state sT [N, H, D, D] fp32) and the grid
(D // BV, N * H), so the runtime swaps the two by plan alone (KDAPlan.inter_tier).

Design (after FlashKDA's recurrence, MoonshotAI/FlashKDA docs/20260420-flashkda-v1-deep-dive.md, written anew):
- Everything is computed transposed, with the V columns as the MMA's M dimension:
      X^T   = V^T - S^T (K e^Gamma)^T                 [BV, BT]
      Vn^T  = X^T (T diag(beta))^T                    [BV, BT]
      O^T   = S^T (scale Q e^Gamma)^T + Vn^T A_qk^T    [BV, BT]
      S^T   = S^T diag(e^Gamma_C) + Vn^T K_d           [BV, D],   K_d = K e^(Gamma_C - Gamma)
  so S^T, X^T and Vn^T are the accumulators of mma.sync (NVMMADistributedLayout version [2, 0]) and each is the A
  operand of the next product: an m16n8 accumulator fragment is, register for register, the m16k16 A fragment
  (gl.convert_layout to the DotOperandLayout moves no data, only the bf16 rounding the portable kernel's bf16
  path does too). No shared-memory round trip of S or of any product.
- The warps split the V columns (warps_per_cta [W, 1]: warp w owns BV / W rows of S^T, 16 per warp by default), so
  a chunk's chain is warp-local: no barrier between its products.
- The chunk's operands that every warp reads whole (K e^Gamma, Q e^Gamma, K_d [BT, D] bf16 and e^Gamma_C [D] fp32)
  come by cp.async into a two-stage shared ring, chunk c + 1's copies in flight during chunk c's chain, and reach
  the products through ldmatrix (transposed views where the product wants a transpose); the small ones (T diag(beta)
  and A_qk [BT, BT] as B operands, V^T [BV, BT] as the first accumulator) are loaded a chunk ahead straight into
  their MMA layouts (a register double buffer). One CTA barrier per chunk: the copies of chunk c have landed and
  every warp is done with the buffer chunk c + 1 overwrites.
- bf16 operands with fp32 accumulation (the portable kernel's dot="bf16" path, rounding at the same points).
What this does not do (yet) that FlashKDA does: a separate load warp (gl.warp_specialize) feeding the MMA warps
through mbarriers instead of the per-chunk CTA barrier.
"""
from __future__ import annotations

from ..kernel import KernelSource
from ..targets import Target
from ..writer import CodegenError, SourceWriter, ident, name_part
from .common import check_dim, check_float

HOPPER_ARCH = "sm_90"       # Target.arch of the chips this tier serves (compiled for sm_90a)
MMA_M = 16                  # rows of one mma.sync tile: the V columns a warp owns per tile
K_SPLITS = (1, 2)           # parts of the state's K columns: independent MMA chains in the K-reduced products (4
                            # spills at BV 64 with fp32 o: 255 registers + 12 spilled)
K_SPLIT = 2                 # the default: X^T = V^T - S^T (K e^G)^T as two chains of D / 32 MMAs instead of one of
                            # D / 16 (the longest link of the serial chain; +8 registers). Unmeasured


def _pow2(x: int) -> bool:
    return x > 0 and not x & (x - 1)


def hopper_inter_problem(head_dim: int, chunk: int, block_v: int, warps: int, dot: str, target: Target,
                         k_split: int = 1) -> str:
    """Why the Gluon state-passing kernel does not serve this shape ("" when it does): an sm_90 cuda target, bf16
    products (mma.sync on bf16 operands, fp32 accumulation), 16-token chunks, D a power of two in [16, 128] and
    1, 2, 4 or 8 warps owning 16 V columns each (BV = 16 x warps <= D). Past that the state slice and the chunk's
    operands outgrow 255 registers: 32-token chunks, 32 V columns a warp or D = 256 spill on sm_90 (Triton 3.9).
    k_split: the state's K columns in 1 or 2 parts of at least 16."""
    if target.arch != HOPPER_ARCH or target.backend != "cuda":
        return f"needs an sm_90 cuda target, got {target.name} ({target.backend} {target.arch})"
    if dot != "bf16":
        return f"needs bf16 products (dot='bf16'), got dot={dot!r}"
    if not (_pow2(head_dim) and 16 <= head_dim <= 128):
        return f"needs head_dim a power of two in [16, 128], got {head_dim}"
    if chunk != 16:
        return f"needs 16-token chunks, got {chunk}"
    if warps not in (1, 2, 4, 8):
        return f"needs 1, 2, 4 or 8 warps, got {warps}"
    if block_v != MMA_M * warps or block_v > head_dim:
        return (f"needs block_v = {MMA_M} x warps <= head_dim (each warp owns {MMA_M} V columns), got block_v="
                f"{block_v} with {warps} warps, head_dim {head_dim}")
    if k_split not in K_SPLITS or head_dim // k_split < 16:
        return f"needs k_split in {K_SPLITS} with head_dim / k_split >= 16, got k_split={k_split}"
    return ""


def _blocked(rows: int, cols: int, vec: int, warps: int) -> str:
    """A BlockedLayout for a [rows, cols] copy with `vec` contiguous elements a thread, threads along the columns
    first; warps along the rows while they fit, then along the columns (small tiles: some threads repeat)."""
    vec = max(1, min(vec, cols))
    tc = max(1, min(32, cols // vec))
    tr = 32 // tc
    wr = max(1, min(warps, rows // tr)) if rows >= tr else 1
    wc = warps // wr
    return f"gl.BlockedLayout([1, {vec}], [{tr}, {tc}], [{wr}, {wc}], [1, 0])"


def emit_kda_inter_hopper(num_heads: int, head_dim: int, *, target: Target, chunk: int = 16, block_v: int = 64,
                          warps: int = 4, k_split: int = K_SPLIT, dot: str = "bf16", v_dtype: str = "bf16",
                          o_dtype: str = "bf16", has_initial_state: bool = True, ir_op: str = "kda_inter",
                          loc: str = "") -> KernelSource:
    """The state-passing kernel of the KDA prefill (module doc). Args as the portable emit_kda_inter: ki, qi, di
    [total, H, D] bf16, ai, ti [total, H, BT] bf16, ei [slots, H, D] fp32, v [*, H, D] at token stride sv, o
    [total, H, D], s0 / sT [N, H, D, D] fp32 (s0 read when has_initial_state; may alias sT), cu [N + 1] i32, sv, N.
    Grid (D // BV, N * H). k_split: the state S^T [BV, D] is held as k_split parts of D / k_split columns, so the
    products that reduce over D (S^T (K e^G)^T, S^T (Q e^G)^T) run as k_split independent MMA chains."""
    H, D = check_dim(num_heads, "num_heads"), check_dim(head_dim, "head_dim")
    check_float(o_dtype)
    check_float(v_dtype, "v_dtype")
    BT, BV, W, nk = int(chunk), int(block_v), int(warps), int(k_split)
    why = hopper_inter_problem(D, BT, BV, W, dot, target, nk)
    if why:
        raise CodegenError(f"hopper KDA state passing: {why}")
    idt = "bf16"
    kname = ident(f"k3c_kda_inter_hopper_h{H}_d{D}_bt{BT}_bv{BV}_w{W}_k{nk}_v{name_part(v_dtype)}"
                  f"_o{name_part(o_dtype)}"
                  + ("" if has_initial_state else "_nos0"))
    sig = {"ki": f"*{idt}", "qi": f"*{idt}", "di": f"*{idt}", "ai": f"*{idt}", "ti": f"*{idt}", "ei": "*fp32",
           "v": f"*{v_dtype}", "o": f"*{o_dtype}", "s0": "*fp32", "sT": "*fp32", "cu": "*i32", "sv": "i32",
           "N": "i32"}
    const = {"H": H, "D": D, "BT": BT, "BV": BV}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda state passing, Hopper tier (Gluon, sm_90a, mma.sync, state in registers): H={H} D={D} "
                    f"BT={BT} BV={BV} warps={W} ({BV // W} V columns a warp) state in {nk} K parts v:{v_dtype} "
                    f"o:{o_dtype}"])
    w.line("from triton.experimental import gluon")
    w.line("from triton.experimental.gluon import language as gl")
    w.line("from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2")
    w.blank()
    gdt = {"bf16": "gl.bfloat16", "fp16": "gl.float16", "fp32": "gl.float32"}
    repl = {
        "{KNAME}": kname,
        "{W}": str(W),
        "{SWZ}": str(min(128, 2 * D // nk)),   # a K part's bf16 row bytes, up to the widest swizzle
        "{LD_K}": _blocked(BT, D, 8, W),
        "{LD_E}": f"gl.BlockedLayout([{max(1, min(4, D // (32 * W)))}], [32], [{W}], [0])",
        "{ODT}": gdt[o_dtype],
    }
    src = SOURCE + "\n\n" + _chunk_source(nk) + "\n\n" + _kernel_source(nk, has_initial_state)
    for k_, v_ in repl.items():
        src = src.replace(k_, v_)
    for line in src.strip("\n").splitlines():
        w.line(line)
    w.blank()
    return KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const,
                        grid=("D // BV", "N * H"), num_warps=W, num_stages=1, ir_op=ir_op, loc=loc)


# The kernel text: the helpers here, then _chunk_source and _kernel_source (generated for the number of K parts).
# Placeholders: {KNAME} {W} {SWZ} {LD_K} {LD_E} {ODT}, replaced by checked names, numbers and layouts only. Names:
# S^T is st0 .. st{k_split - 1} ([BV, D / k_split] each, the MMA accumulator layout); a stage of the ring is kg_*,
# qg_*, kd_* ([BT, D] bf16) and eg_* ([D] fp32).
SOURCE = """
@gluon.jit
def _issue(ki, qi, di, ei, kg_s, qg_s, kd_s, eg_s, bos, L, at, slot, h,
           H: gl.constexpr, D: gl.constexpr, BT: gl.constexpr, LD_K: gl.constexpr, LD_E: gl.constexpr):
    # chunk `at` (token offset in the sequence) of the shared operands into one stage of the ring by cp.async (rows past
    # the sequence's end are zero-filled: they belong to the next sequence or lie past the tensor)
    rt = gl.arange(0, BT, layout=gl.SliceLayout(1, LD_K))
    rk = gl.arange(0, D, layout=gl.SliceLayout(0, LD_K))
    m = ((at + rt) < L)[:, None]
    off = (bos + at + rt).to(gl.int64)[:, None] * (H * D) + h * D + rk[None, :]
    async_copy.async_load(kg_s, ki + off, mask=m)
    async_copy.async_load(qg_s, qi + off, mask=m)
    async_copy.async_load(kd_s, di + off, mask=m)
    re = gl.arange(0, D, layout=LD_E)
    async_copy.async_load(eg_s, ei + (slot.to(gl.int64) * H + h) * D + re, mask=(re * 0 + at) < L)
    async_copy.commit_group()


@gluon.jit
def _state_offsets(nh, pv, k0, DK: gl.constexpr, D: gl.constexpr, BV: gl.constexpr, MMA: gl.constexpr):
    # S^T[:, k0 : k0 + DK] of [BV, D]: row v is V column pv * BV + v of the state, column k its K row k0 + k
    # (S[k, v] at nh * D * D + k * D + v)
    rv = pv * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, MMA))
    rk = k0 + gl.arange(0, DK, layout=gl.SliceLayout(0, MMA))
    return nh.to(gl.int64) * D * D + rk[None, :] * D + rv[:, None]


@gluon.jit
def _small(ai, ti, v, sv, bos, L, at, h, pv,
           H: gl.constexpr, D: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, MMA: gl.constexpr,
           OPB: gl.constexpr):
    # chunk `at`'s small operands straight into their MMA layouts: A_qk^T and (T diag(beta))^T as B operands
    # (B[k, n] = A[n, k]: row n of the intra kernel's output, column k) and V^T [BV, BT] as an accumulator
    bk = gl.arange(0, BT, layout=gl.SliceLayout(1, OPB))
    bn = gl.arange(0, BT, layout=gl.SliceLayout(0, OPB))
    boff = (bos + at + bn).to(gl.int64)[None, :] * (H * BT) + h * BT + bk[:, None]
    bm = ((at + bn) < L)[None, :]
    aq = gl.load(ai + boff, mask=bm, other=0.0)
    tb = gl.load(ti + boff, mask=bm, other=0.0)
    vr = pv * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, MMA))
    vt = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
    vc = gl.load(v + (bos + at + vt).to(gl.int64)[None, :] * sv + h * D + vr[:, None],
                 mask=((at + vt) < L)[None, :], other=0.0).to(gl.float32)
    return aq, tb, vc


"""


def _sum(terms: list[str]) -> str:
    """A pairwise sum (the partial products of the K parts add in a tree, not a chain)."""
    while len(terms) > 1:
        terms = [f"({terms[i]} + {terms[i + 1]})" if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def _chunk_source(nk: int) -> str:
    """`_chunk`: one chunk step with the state in nk parts of D / nk K columns (S^T[:, i DK : (i + 1) DK] in st{i})."""
    st = ", ".join(f"st{i}" for i in range(nk))
    sl = "slice({i} * DK, DK, dim=1)"
    lines = [
        "@gluon.jit",
        f"def _chunk({st}, aq, tb, vc, kg_s, qg_s, kd_s, eg_s, kg_n, qg_n, kd_n, eg_n, ki, qi, di, ai, ti, ei, v, o, "
        "sv, bos, L, c,",
        "           slot0, h, pv, H: gl.constexpr, D: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, "
        "MMA: gl.constexpr,",
        "           LD_K: gl.constexpr, LD_E: gl.constexpr, ODT: gl.constexpr):",
        "    # chunk c from the stage (kg_s, qg_s, kd_s, eg_s) and the registers (aq, tb, vc); chunk c + 1's",
        "    # operands go into the other stage (kg_n, ...) and registers, in flight during this chunk's chain",
        "    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)",
        "    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)",
        f"    DK: gl.constexpr = D // {nk}",
        "    at = c * BT",
        "    # chunk c's copies have landed (every thread's), every warp is done with the other stage (chunk c - 1)",
        "    async_copy.wait_group(0)",
        "    gl.barrier()",
        "    _issue(ki, qi, di, ei, kg_n, qg_n, kd_n, eg_n, bos, L, at + BT, slot0 + c + 1, h, H, D, BT, LD_K, LD_E)",
        "    aq_n, tb_n, vc_n = _small(ai, ti, v, sv, bos, L, at + BT, h, pv, H, D, BT, BV, MMA, OPB)",
        "    # the chain: every product's accumulator is the next one's A operand, in registers; the K parts' partial",
        "    # products are independent chains of DK / 16 MMAs",
        "    zero = gl.zeros([BV, BT], gl.float32, layout=MMA)",
    ]
    for i in range(nk):
        lines.append(f"    sa{i} = gl.convert_layout(st{i}.to(gl.bfloat16), OPA)")
    for i in range(nk):
        lines.append(f"    x{i} = mma_v2(sa{i}, kg_s.{sl.format(i=i)}.permute((1, 0)).load(OPB), zero)")
    lines += [
        f"    x = vc - {_sum([f'x{i}' for i in range(nk)])}",
        "    xa = gl.convert_layout(x.to(gl.bfloat16), OPA)",
        "    vn = gl.convert_layout(mma_v2(xa, tb, zero).to(gl.bfloat16), OPA)",
    ]
    for i in range(nk):
        lines.append(f"    y{i} = mma_v2(sa{i}, qg_s.{sl.format(i=i)}.permute((1, 0)).load(OPB), zero)")
    lines.append(f"    oc = mma_v2(vn, aq, {_sum([f'y{i}' for i in range(nk)])})")
    for i in range(nk):
        lines += [
            f"    eg = eg_s.slice({i} * DK, DK).load(gl.SliceLayout(0, MMA))",
            f"    st{i} = mma_v2(vn, kd_s.{sl.format(i=i)}.load(OPB), st{i} * eg[None, :])",
        ]
    lines += [
        "    ot = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))",
        "    rv = pv * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, MMA))",
        "    gl.store(o + (bos + at + ot).to(gl.int64)[None, :] * (H * D) + h * D + rv[:, None], oc.to(ODT),",
        "             mask=((at + ot) < L)[None, :])",
        f"    return {st}, aq_n, tb_n, vc_n",
    ]
    return "\n".join(lines) + "\n"


def _kernel_source(nk: int, has_initial_state: bool) -> str:
    """The kernel: the ring, the state (nk parts), the chunk loop unrolled by two over the ring's stages."""
    st = ", ".join(f"st{i}" for i in range(nk))
    lines = [
        "@gluon.jit",
        "def {KNAME}(ki, qi, di, ai, ti, ei, v, o, s0, sT, cu, sv, N,",
        "        H: gl.constexpr, D: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr):",
        "    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[{W}, 1], "
        "instr_shape=[16, 8])",
        "    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)",
        "    LD_K: gl.constexpr = {LD_K}",
        "    LD_E: gl.constexpr = {LD_E}",
        "    SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width={SWZ}, element_bitwidth=16, rank=2)",
        "    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])",
        f"    DK: gl.constexpr = D // {nk}",
        "    pv = gl.program_id(0)",
        "    nh = gl.program_id(1)",
        "    n = nh // H",
        "    h = nh % H",
        "    start = gl.load(cu + n)",
        "    L = gl.load(cu + n + 1) - start",
        "    bos = start.to(gl.int64)",
        "    slot0 = start // BT + n",
        "    # the operand ring: two stages as separate allocations (stage 0 serves even chunks, stage 1 odd ones),",
        "    # so the barrier analysis sees that chunk c + 1's copies do not touch what chunk c reads",
    ]
    for b in range(2):
        lines += [f"    {x}_{b} = gl.allocate_shared_memory(gl.bfloat16, [BT, D], SW)" for x in ("kg", "qg", "kd")]
        lines.append(f"    eg_{b} = gl.allocate_shared_memory(gl.float32, [D], FLAT)")
    lines.append("    _issue(ki, qi, di, ei, kg_0, qg_0, kd_0, eg_0, bos, L, 0, slot0, h, H, D, BT, LD_K, LD_E)")
    for i in range(nk):
        lines.append(f"    st{i} = gl.load(s0 + _state_offsets(nh, pv, {i} * DK, DK, D, BV, MMA))" if has_initial_state
                     else f"    st{i} = gl.zeros([BV, DK], gl.float32, layout=MMA)")
    lines += [
        "    aq, tb, vc = _small(ai, ti, v, sv, bos, L, 0, h, pv, H, D, BT, BV, MMA, OPB)",
        "    n_chunks = gl.cdiv(L, BT)",
        "    for c in range(0, n_chunks, 2):",
        f"        {st}, aq, tb, vc = _chunk({st}, aq, tb, vc, kg_0, qg_0, kd_0, eg_0, kg_1, qg_1, kd_1, eg_1, ki,",
        "            qi, di, ai, ti, ei, v, o, sv, bos, L, c, slot0, h, pv, H, D, BT, BV, MMA, LD_K, LD_E, {ODT})",
        "        if c + 1 < n_chunks:",
        f"            {st}, aq, tb, vc = _chunk({st}, aq, tb, vc, kg_1, qg_1, kd_1, eg_1, kg_0, qg_0, kd_0, eg_0,",
        "                ki, qi, di, ai, ti, ei, v, o, sv, bos, L, c + 1, slot0, h, pv, H, D, BT, BV, MMA, LD_K, LD_E,",
        "                {ODT})",
        "    async_copy.wait_group(0)",
        "    # the offsets again, from an opaque zero (L >= 0): kept from before the loop they held 128 registers",
        "    # through it",
        "    z = L >> 31",
    ]
    for i in range(nk):
        lines.append(f"    gl.store(sT + _state_offsets(nh, pv + z, {i} * DK, DK, D, BV, MMA), st{i})")
    return "\n".join(lines) + "\n"


__all__ = ["HOPPER_ARCH", "hopper_inter_problem", "emit_kda_inter_hopper"]
