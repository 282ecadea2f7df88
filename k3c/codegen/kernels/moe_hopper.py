"""The Hopper form of the upcast grouped GEMM (sm_90, bf16 activations): routed MXFP4 experts stored in a load-time
"hopper" layout in which every thread of a warp loads whole 16-byte pieces of its wgmma A-operand fragment and a
warp's pieces fill whole cache lines; the decoded tile feeds wgmma from registers (no shared-memory round trip).

wgmma takes A ([64 rows per warpgroup, 16 K] per instruction) from registers in the mma.sync fragment order: lane
l = 4 g + c of a warp holds rows g and g + 8 of its 16 rows and, in each 16-K step, the K pairs (2c, 2c + 1) and
(2c + 8, 2c + 9). A packed byte holds one K pair (element 2i in the low nibble), so per 32 bytes of a row (64 K, four
16-K steps) lane c needs the bytes 4 i + c, i = 0..7, of rows g and g + 8. The value layout stores those 16 bytes
contiguously, and the pieces of the lanes that share a row pair next to each other:

    canonical (row n, byte kb) of an expert's [N, K/2] payload, n = 16 B + 8 h + 2 s + p, kb = 32 t + 8 j + 4 i + c
    -> stored [N/4, 2K] row 4 B + s, column 128 t + 64 p + 16 c + 4 j + 2 i + h

so a stored 32-bit word (j) holds the four bytes of one 16-K step of one lane ((i, h): rows g, g + 8 at pairs c and
c + 4), the 8 lanes of two rows' pairs read 128 contiguous bytes, and the 32 lanes of a warp four whole lines. The 32
bits of each word are then put in the perm order of k3c's pair decode (moe_lanes.pairs_perm_bit_map): one prmt and
one and per bf16x2 pair (E2M1 value x 2^-126), 11 integer ops per 8 weights. The block scale is one bf16x2 multiply
per pair afterwards: by 2^(s - 1) where every scale is <= PAIRS1_MAX_SCALE (exact: the product of two exact bf16
values rounded once, as the reference's bf16 dequantization), else the pattern is first made the exact value (x
2^126) and multiplied by 2^(s - 127). The E8M0 scales get a layout of the same kind, per 16 rows:

    canonical (row n, block kc) of [N, K/32], n = 16 R + 8 h + g, kc = 2 m + a  ->  stored [N/16, K/2] row R,
    column 32 m + 4 g + 2 a + h

(the four scales of a lane's rows g, g + 8 and two 32-blocks in one 32-bit word). Shapes stay [E, N, K/2] and
[E, N, K/32] (the bytes are rearranged within each expert), so the IR's param types hold; the layout needs N a
multiple of 16 and K of 64. The layout does not depend on the warp count or tile (any BLOCK_N multiple of 16 reads
it). The mapping is the one OpenAI triton_kernels' HopperMXValueLayout uses for its bytes (matmul_ogs reads it the
same way); the bit order and the scale layout are k3c's (its perm decode, scales per 16 rows instead of per warp
group), as is the kernel around it: gate and up as two accumulators with the GLU in the epilogue, down scattered to
slot order for the combine.
"""
from __future__ import annotations

from .moe_lanes import PAIRS_PERM_MASK, PERM_PAIRS, PERM_REGS, _portable_prmt, _portable_regs, ptx_text

HOPPER_ROWS = 16        # rows per value / scale layout unit: N and BLOCK_N are multiples of it
HOPPER_K = 64           # K elements per 32-byte layout chunk of a row: K and BLOCK_K are multiples of it


def _decode_ops(exact: bool) -> list:
    """The perm pair decode without the scale: $4 a stored word; $0..$3 the bf16x2 pairs of its bytes 0..3, each half
    the E2M1 value x 2^-126 (exact: times 2^126, the value itself)."""
    ops = [(kind, r, "$4", n) for r, kind, n in PERM_REGS]
    if exact:
        ops += [("mov", "c", 0x7E807E80)]
    for j, (x, y, sel) in enumerate(PERM_PAIRS):
        ops += [("prmt", f"q{j}", x, y, sel[0] | sel[1] << 4 | sel[2] << 8 | sel[3] << 12),
                ("and", f"${j}" if not exact else f"q{j}", f"q{j}", PAIRS_PERM_MASK)]
        if exact:
            ops += [("mulbf", f"${j}", f"q{j}", "c")]
    return ops


HOPPER_DECODE_OPS = _decode_ops(False)
HOPPER_DECODE_EXACT_OPS = _decode_ops(True)
HOPPER_DECODE_ASM = ptx_text(HOPPER_DECODE_OPS)
HOPPER_DECODE_EXACT_ASM = ptx_text(HOPPER_DECODE_EXACT_OPS)

# the stored value tile [BLOCK_N / 4, 2 BLOCK_K] (x 2 nibbles) as (B, s, t, p, c, j, i, h, nibble) -> the canonical
# [BLOCK_N, BLOCK_K] tile (B, h, s, p | t, j, i, c, nibble); the scales (R, m, g, a, h) -> (R, h, g | m, a)
_VALUE_ORDER = (0, 7, 1, 3, 2, 5, 6, 4, 8)
_SCALE_ORDER = (0, 4, 2, 1, 3)


def hopper_pointers(w, g) -> None:
    """Pointers of the Hopper form: activations [BLOCK_M, BLOCK_K]; per weight the stored value rows
    [BLOCK_N / 4, 2 BLOCK_K] bytes and scale rows [BLOCK_N / 16, BLOCK_K / 2] of the program's N tile."""
    w.line("offs_k = tl.arange(0, BLOCK_K)")
    w.line("a_ptrs = a_ptr + rows_a[:, None] * K + offs_k[None, :]")
    w.line("q_w = (pid_n * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)) % (N // 4)")
    w.line(f"q_s = (pid_n * (BLOCK_N // {HOPPER_ROWS}) + tl.arange(0, BLOCK_N // {HOPPER_ROWS})) % (N // {HOPPER_ROWS})")
    w.line("col_w = tl.arange(0, 2 * BLOCK_K)")
    w.line("col_s = tl.arange(0, BLOCK_K // 2)")
    for x in g.wn:
        w.line(f"{x}_ptrs = {x}_ptr + e64 * (N * (K // 2)) + q_w.to(tl.int64)[:, None] * (2 * K) + col_w[None, :]")
        w.line(f"{x}s_ptrs = {x}s_ptr + e64 * (N * (K // 32)) + q_s.to(tl.int64)[:, None] * (K // 2)"
               f" + col_s[None, :]")


def _scale_lines(x: str, g) -> list[str]:
    """`sc_x` [BLOCK_N, BLOCK_K] = each weight's block multiplier (bf16 2^(s - 1) for the one-multiply decode, else
    2^(s - 127) (the subnormal 2^-127 for s = 0); fp32 2^(s - 127) in the interpreter variant)."""
    lines = [f"s_{x} = tl.reshape(tl.permute(tl.reshape(tl.load({x}s_ptrs).to(tl.int32),"
             f" (BLOCK_N // {HOPPER_ROWS}, BLOCK_K // {HOPPER_K}, 8, 2, 2)), {_SCALE_ORDER}), (BLOCK_N, BLOCK_K // 32))"]
    if g.hopper_asm is None:
        lines.append(f"m_{x} = tl.where(s_{x} == 0, 0x00400000, s_{x} << 23).to(tl.float32, bitcast=True)")
    elif g.plan.one_mul:
        lines.append(f"m_{x} = ((s_{x} + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)")
    else:
        lines.append(f"m_{x} = tl.where(s_{x} == 0, 0x40, s_{x} << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)")
    lines.append(f"sc_{x} = tl.reshape(tl.broadcast_to(m_{x}[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)),"
                 f" (BLOCK_N, BLOCK_K))")
    return lines


def _reorder(src: str) -> str:
    """The stored-order values [BLOCK_N / 4, 4 BLOCK_K] (byte column x 2 + nibble) -> [BLOCK_N, BLOCK_K]."""
    return (f"tl.reshape(tl.permute(tl.reshape({src}, (BLOCK_N // {HOPPER_ROWS}, 4, BLOCK_K // {HOPPER_K}, 2, 4, 4,"
            f" 2, 2, 2)), {_VALUE_ORDER}), (BLOCK_N, BLOCK_K))")


def hopper_step(w, g) -> None:
    """One K step: per weight, the stored words decoded to bf16x2 pairs (PTX, 4 packed bytes per 32-bit register;
    the interpreter variant runs the same bit program in Triton integer ops in fp32), put back in [BLOCK_N, BLOCK_K]
    order (register renaming where the layout matches wgmma's A fragment), scaled per 32-block and multiplied as
    wgmma's A operand (acc [BLOCK_N, BLOCK_M])."""
    w.line(f"a = tl.load(a_ptrs).to({g.op_dt})")
    for x in g.wn:
        w.lines(_scale_lines(x, g))
        if g.hopper_asm is not None:
            w.line(f"r0, r1 = tl.inline_asm_elementwise(\"{g.hopper_asm}\", \"=r,=r,=r,=r,r\", [tl.load({x}_ptrs)],"
                   f" dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)")
            # r0 holds bytes 0, 1 of each word (low, high nibble), r1 bytes 2, 3: back to byte x 2 + nibble order
            w.line(f"v_{x} = tl.reshape(tl.permute(tl.reshape(tl.join(r0, r1), (BLOCK_N // 4, BLOCK_K // 2, 4, 2)),"
                   f" (0, 1, 3, 2)), (BLOCK_N // 4, 4 * BLOCK_K))")
            w.line(f"wv_{x} = {_reorder(f'v_{x}')} * sc_{x}")
        else:
            w.line(f"b_{x} = tl.reshape(tl.load({x}_ptrs).to(tl.uint32), (BLOCK_N // 4, BLOCK_K // 2, 2, 2))")
            w.line(f"e02, e13 = tl.split(b_{x})")
            w.line("e0, e2 = tl.split(e02)")
            w.line("e1, e3 = tl.split(e13)")
            w.line("wd = e0 | (e1 << 8) | (e2 << 16) | (e3 << 24)")
            w.lines(_portable_regs())
            for j, (a, b, sel) in enumerate(PERM_PAIRS):
                w.line(_portable_prmt(f"q{j}", a, b, sel))
                w.line(f"q{j} = q{j} & {PAIRS_PERM_MASK}")
                # each bf16 half holds value x 2^-126: in fp32, times 2^126 (exact)
                w.line(f"p{j} = tl.join((q{j} << 16).to(tl.float32, bitcast=True) * 8.507059173023462e+37,"
                       f" (q{j} & 0xFFFF0000).to(tl.float32, bitcast=True) * 8.507059173023462e+37)")
            # [word, nibble, x, y] (byte 2 x + y) -> [word, byte, nibble]
            w.line(f"v_{x} = tl.reshape(tl.permute(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (0, 1, 3, 4, 2)),"
                   f" (BLOCK_N // 4, 4 * BLOCK_K))")
            w.line(f"wv_{x} = ({_reorder(f'v_{x}')} * sc_{x}).to({g.op_dt})")
        w.line(f"acc_{x} = tl.dot(wv_{x}, tl.trans(a), acc_{x}{g.dot_kw})")
    w.line("a_ptrs += BLOCK_K")
    for x in g.wn:
        w.line(f"{x}_ptrs += 2 * BLOCK_K")
        w.line(f"{x}s_ptrs += BLOCK_K // 2")


__all__ = ["HOPPER_ROWS", "HOPPER_K", "HOPPER_DECODE_ASM", "HOPPER_DECODE_EXACT_ASM", "HOPPER_DECODE_OPS",
           "HOPPER_DECODE_EXACT_OPS", "hopper_pointers", "hopper_step"]
