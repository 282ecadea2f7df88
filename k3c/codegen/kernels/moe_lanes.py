"""The lanes form of the upcast grouped GEMM (sm_90, bf16 activations): the MXFP4 weight tile is wgmma's A operand
straight from registers, loaded from a load-time layout in which every thread's bytes are contiguous.

wgmma takes A ([64 rows per warpgroup, 16 K]) from registers in the mma.sync fragment order: lane l of a warp holds
rows g = l / 4 and g + 8 of its 16, and in each 16-K step the K pairs (2c, 2c + 1) and (2c + 8, 2c + 9), c = l % 4.
A packed byte holds one K pair (element 2i in the low nibble), so per 128-K group lane c of a row needs the bytes
4i + c (i = 0..15) of the row's 64. The lanes layout stores them contiguously:

    byte c * 16 + i of every 64-byte group of a row  <-  canonical byte 4 i + c          (LANES_GROUP_K = 128)

and then permutes the 32 bits of each stored word (4 bytes = 8 weights of one 32-block) into the perm order, where
the bf16x2 pair decode is one prmt and one and per pair (E2M1_PAIRS_PERM_OPS; 11 integer ops per 8 weights against
17 for the canonical order). So a lane loads 16 contiguous bytes per row and 128-K group, decodes each byte to the
bf16x2 register of its K pair with the block scale applied (exact), and the tile reshapes into the dot operand
layout without a shared-memory round trip; the activations are wgmma's B operand from shared memory, and the
accumulator [BLOCK_N, BLOCK_M] is transposed once after the K loop (the swap epilogue). The 32-blocks, the scales
[N, K/32] and their layout stay canonical; only the payload's byte and bit order change, once, at load
(k3c.runtime.kernel_impls.moe_layout), so the IR and the checkpoints keep k3c.quant's format.

(Translates of a pair's bit positions do not tile 32 bits, so one shift + one and per pair cannot cover a word; a
search over shift / rotate / prmt programs found none cheaper than the perm program.)
"""
from __future__ import annotations

LANES_GROUP_K = 128           # K elements (64 bytes of a row) per lanes group; BLOCK_K and K are multiples of it
LANES_ROWS = 64               # wgmma's M per warpgroup: BLOCK_N is a multiple of it on GPUs

# A pair's bits sit at P = {6, 7, 8, 15, 22, 23, 24, 31} of its bf16x2 register (magnitude e1 e0 m at 8..6, sign at
# 15, twice); with the word's bits placed for it, one prmt gathers the pair's bytes from two of four registers (the
# word, rotated right by 1 and by 3, shifted left by 2) and one and keeps P.
PAIRS_PERM_MASK = 0x81C081C0
PERM_REGS = (("r1", "shfw", 1), ("r3", "shfw", 3), ("l2", "shl", 2))
PERM_PAIRS = (("$4", "r1", (0, 4, 1, 7)), ("$4", "r3", (2, 4, 3, 7)), ("r1", "l2", (4, 1, 5, 2)),
              ("l2", "r3", (2, 5, 3, 6)))


def _pairs_perm_ops(one_mul: bool) -> list:
    """The op list of the perm pair decode: $4 a stored word, $5 its block's E8M0 scale; $0..$3 the bf16x2 pairs of
    its bytes 0..3. Scale as k3c's canonical pair decode: one multiply by 2^(s - 1) (exact for s <= 128), or two."""
    ops = [("mad", "m", "$5", 0x800080, 126 * 0x800080)] if one_mul else \
        [("mov", "c", 0x7E807E80), ("mul", "m", "$5", 0x800080), ("mov", "lo", 0x00400040),
         ("max16", "m", "m", "lo")]
    ops += [(kind, r, "$4", n) for r, kind, n in PERM_REGS]
    for j, (x, y, sel) in enumerate(PERM_PAIRS):
        ops += [("prmt", f"q{j}", x, y, sel[0] | sel[1] << 4 | sel[2] << 8 | sel[3] << 12),
                ("and", f"q{j}", f"q{j}", PAIRS_PERM_MASK)]
        ops += [("mulbf", f"${j}", f"q{j}", "m")] if one_mul else \
            [("mulbf", f"q{j}", f"q{j}", "c"), ("mulbf", f"${j}", f"q{j}", "m")]
    return ops


def pairs_perm_bit_map() -> tuple[int, ...]:
    """stored bit -> canonical bit of the perm order (a permutation of 0..31), derived from the op list itself: the
    bits of pair j's register at P are traced back through the shifts and prmt to the stored word, and bit i of P
    must hold canonical bit 8 j + (0, 1, 2, 3, 4, 5, 6, 7)[P.index(i)] (the low nibble's m, e0, e1, sign, then the
    high nibble's), which is what the canonical decode places there."""
    regs = {"$4": list(range(32))}
    for r, kind, n in PERM_REGS:
        w = regs["$4"]
        regs[r] = [w[(i + n) % 32] for i in range(32)] if kind == "shfw" else \
            [w[i - n] if i >= n else None for i in range(32)]
    pos = [i for i in range(32) if PAIRS_PERM_MASK >> i & 1]
    stored_to_canon = [None] * 32
    for j, (x, y, sel) in enumerate(PERM_PAIRS):
        src = regs[x] + regs[y]
        q = [src[8 * sel[i // 8] + i % 8] for i in range(32)]
        for t, i in enumerate(pos):
            assert q[i] is not None and stored_to_canon[q[i]] is None, "perm decode: a bit used twice"
            stored_to_canon[q[i]] = 8 * j + t
    assert sorted(stored_to_canon) == list(range(32))
    return tuple(stored_to_canon)


def ptx_text(ops) -> str:
    """PTX text of an op list: b32 integer ops, rotate right (shfw: a funnel shift of a register with itself), prmt,
    u16x2 max, bf16x2 multiplies."""
    regs = sorted({o[1] for o in ops if not o[1].startswith("$")})
    out = ["{ .reg .b32 " + ", ".join(regs) + ";"]
    for op, d, *src in ops:
        args = ", ".join([d] + [hex(x) if isinstance(x, int) else x for x in src])
        if op == "shfw":
            out.append(f"shf.r.wrap.b32 {d}, {src[0]}, {src[0]}, {src[1]};")
            continue
        out.append({"shl": "shl.b32", "shr": "shr.u32", "and": "and.b32", "or": "or.b32", "mov": "mov.b32",
                    "mul": "mul.lo.u32", "mad": "mad.lo.u32", "max16": "max.u16x2", "prmt": "prmt.b32",
                    "mulbf": "mul.rn.bf16x2"}[op] + f" {args};")
    return " ".join(out + ["}"])


E2M1_PAIRS_PERM_OPS = _pairs_perm_ops(False)
E2M1_PAIRS1_PERM_OPS = _pairs_perm_ops(True)
E2M1_PAIRS_PERM_ASM = ptx_text(E2M1_PAIRS_PERM_OPS)
E2M1_PAIRS1_PERM_ASM = ptx_text(E2M1_PAIRS1_PERM_OPS)


def _portable_regs() -> list[str]:
    """Triton lines of the perm program's shifts (uint32 `wd` the stored words), for the interpreter variant."""
    out = []
    for r, kind, n in PERM_REGS:
        out.append(f"{r} = (wd >> {n}) | (wd << {32 - n})" if kind == "shfw" else f"{r} = wd << {n}")
    return out


def _portable_prmt(d: str, x: str, y: str, sel) -> str:
    """`d` = prmt(x, y, sel) in uint32 Triton ops (selector nibbles < 8: no sign replication)."""
    src = {"$4": "wd"}
    parts = []
    for i, s in enumerate(sel):
        reg = src.get(x if s < 4 else y, x if s < 4 else y)
        parts.append(f"(((({reg}) >> {8 * (s % 4)}) & 0xFF) << {8 * i})")
    return f"{d} = " + " | ".join(parts)


def lanes_pointers(w, g) -> None:
    """Pointers of the lanes form: activations [BLOCK_M, BLOCK_K]; per weight the stored words [BLOCK_N, G, 4 (the
    lane c), 4 (word w: its 32-block)] of the lanes layout (G = BLOCK_K / 128 groups per step) and the canonical
    scales [BLOCK_N, G, 4] of those blocks."""
    w.line("offs_k = tl.arange(0, BLOCK_K)")
    w.line("a_ptrs = a_ptr + rows_a[:, None] * K + offs_k[None, :]")
    w.line(f"LG: tl.constexpr = BLOCK_K // {LANES_GROUP_K}")
    w.line("wq = (tl.arange(0, LG)[:, None, None] * 16 + tl.arange(0, 4)[None, :, None] * 4"
           " + tl.arange(0, 4)[None, None, :])")
    w.line("sq = tl.arange(0, LG)[:, None] * 4 + tl.arange(0, 4)[None, :]")
    for x in g.wn:
        w.line(f"{x}_wptrs = {x}_ptr.to(tl.pointer_type(tl.int32)) + e64 * (N * (K // 8))"
               f" + rows_w[:, None, None, None] * (K // 8) + wq[None, :, :, :]")
        w.line(f"{x}s_ptrs = {x}s_ptr + e64 * (N * (K // 32)) + rows_w[:, None, None] * (K // 32) + sq[None, :, :]")


def lanes_step(w, g) -> None:
    """One K step of the lanes form: per weight, the words decoded to bf16x2 K pairs with their block scale (PTX;
    the interpreter variant runs the same bit program in Triton integer ops and scales in fp32), reordered into the
    [BLOCK_N, BLOCK_K] tile (K = 128 group + 8 i + 2 c + half) and multiplied as wgmma's A operand."""
    w.line(f"a = tl.load(a_ptrs).to({g.op_dt})")
    for x in g.wn:
        w.line(f"s_{x} = tl.broadcast_to(tl.load({x}s_ptrs).to(tl.int32)[:, :, None, :], (BLOCK_N, LG, 4, 4))")
        if g.lanes_asm is not None:
            w.line(f"o0, o1, o2, o3 = tl.inline_asm_elementwise(\"{g.lanes_asm}\", \"=r,=r,=r,=r,r,r\","
                   f" [tl.load({x}_wptrs), s_{x}], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,"
                   f" pack=1)")
            w.line(f"v_{x} = tl.permute(tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)),"
                   f" (BLOCK_N, LG, 4, 16)), (0, 1, 3, 2))  # [n, group, i, c]")
            w.line(f"wv_{x} = tl.reshape(tl.join(v_{x}.to(tl.int16).to(tl.bfloat16, bitcast=True),"
                   f" (v_{x} >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)), (BLOCK_N, BLOCK_K))")
        else:
            w.line(f"wd = tl.load({x}_wptrs).to(tl.uint32, bitcast=True)")
            w.lines(_portable_regs())
            for j, (a, b, sel) in enumerate(PERM_PAIRS):
                w.line(_portable_prmt(f"q{j}", a, b, sel))
                w.line(f"q{j} = q{j} & {PAIRS_PERM_MASK}")
            # each bf16 half holds value x 2^-126: times 2^126, then the block's 2^(s - 127) (2^-127 for s = 0, an
            # fp32 subnormal); both exact in fp32, as the two bf16x2 multiplies of the exact PTX decode
            w.line(f"sc_{x} = tl.where(s_{x} == 0, 0x00400000, s_{x} << 23).to(tl.float32, bitcast=True)")
            for j in range(4):
                w.line(f"lo{j} = (q{j} << 16).to(tl.float32, bitcast=True) * 8.507059173023462e+37 * sc_{x}")
                w.line(f"hi{j} = (q{j} & 0xFFFF0000).to(tl.float32, bitcast=True) * 8.507059173023462e+37"
                       f" * sc_{x}")
                w.line(f"p{j} = tl.join(lo{j}, hi{j})")
            w.line(f"v_{x} = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BLOCK_N, LG, 4, 4, 2, 2, 2))")
            # [n, group, c, w, half, j1, j0] -> [n, group, w, j1, j0, c, half]: K = 128 g + 32 w + 8 j + 2 c + h
            w.line(f"wv_{x} = tl.reshape(tl.permute(v_{x}, (0, 1, 3, 5, 6, 2, 4)), (BLOCK_N, BLOCK_K))")
        w.line(f"acc_{x} = tl.dot(wv_{x}, tl.trans(a), acc_{x}{g.dot_kw})")
    w.line("a_ptrs += BLOCK_K")
    for x in g.wn:
        w.line(f"{x}_wptrs += BLOCK_K // 8")
        w.line(f"{x}s_ptrs += BLOCK_K // 32")
