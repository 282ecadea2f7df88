"""KDA's prefill prep (short conv + SiLU, L2 norms, gate, beta) on the Hopper tier (Gluon, sm_90a): the portable
`emit_kda_prep`'s arguments, grid (one program per time block, sequence, head and role) and outputs.

Why a tier kernel: the conv's taps read each input row KW times. The portable kernel loads KW shifted [BT, D] tiles
from global memory (L1 hits after the first), which costs KW times the load instructions and holds the taps' tiles
in registers at once (128 registers at 32 tokens on sm_90): it ran at 47% of a copy of its bytes on the H100
(docs/perf.md, KDA). Here a q / k / v program loads its BT rows and the KW - 1 rows before them once into shared
memory and reads the KW shifted windows from there; the rows before a segment's start come from the conv tails.
Opt-in (`kda_prep(..., tier="hopper")`) until bench/kda.py has timed it.
"""
from __future__ import annotations

from dataclasses import replace

from ..kernel import KernelSource
from ..targets import Target
from ..tiers import tier_of
from ..writer import CodegenError, SourceWriter, fnum, ident, name_part
from .common import check_dim, check_float
from .kda import (PREP_BLOCK_T, _check_gate, _check_pow2, emit_kda_prep, prep_role_pointers, prep_signature,
                  prep_tail_update)
from .kda_decode_hopper import HOPPER_ARCH, gl_cast, gl_gate, gl_module_head, gl_round


def hopper_prep_supported(head_dim: int, block_t: int, conv_kernel: int, warps: int, target: Target) -> bool:
    """An sm_90 target with the hopper tier; D a power of two in [32, 256] (rows of 8-element vectors over at most
    32 lanes); BT a power of two of at least the halo (KW - 1 rows, rounded up to a power of two) and of the warps'
    rows."""
    halo = _halo(conv_kernel)
    lanes_d = head_dim // 8
    return (target.backend == "cuda" and target.arch == HOPPER_ARCH and target.has_tier("hopper")
            and 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and block_t & (block_t - 1) == 0
            and block_t >= max(halo, (32 // lanes_d) * warps))


def _halo(conv_kernel: int) -> int:
    return 1 << max(0, (conv_kernel - 2).bit_length())


def emit_kda_prep_hopper(num_heads: int, head_dim: int, conv_kernel: int, *, gate: str, gate_lower_bound: float,
                         l2norm_eps: float, target: Target, dtype: str = "bf16", qkv_dtype: str = "fp32",
                         block_t: int | None = None, ir_op: str = "kda_prep", loc: str = "") -> KernelSource:
    H, D, KW = check_dim(num_heads, "num_heads"), _check_pow2(head_dim, "head_dim"), check_dim(conv_kernel, "conv")
    if KW < 2:
        raise CodegenError(f"conv_kernel must be >= 2, got {KW}")
    check_float(dtype)
    check_float(qkv_dtype, "qkv_dtype")
    _check_gate(gate, gate_lower_bound)
    BT = _check_pow2(block_t or PREP_BLOCK_T, "block_t")
    NW = max(4, min(8, BT * D // 256))
    if not hopper_prep_supported(D, BT, KW, NW, target):
        raise CodegenError(f"hopper KDA prep: needs an sm_90 cuda target with the hopper tier, head_dim a power of two "
                           f"in [32, 256] and block_t a power of two covering the conv's halo and the warps' rows; got "
                           f"{target.name} ({target.backend} {target.arch}) D={D} BT={BT} conv={KW} warps={NW}")
    HD, HALO, LD = H * D, _halo(KW), D // 8
    kname = ident(f"k3c_kda_prep_hopper_h{H}_d{D}_k{KW}_{gate}_{name_part(dtype)}"
                  + ("" if qkv_dtype == "fp32" else f"_o{name_part(qkv_dtype)}") + f"_t{BT}")
    sig = prep_signature(dtype, qkv_dtype)
    const = {"H": H, "D": D, "KW": KW, "BT": BT}
    w = SourceWriter()
    w.header(kernel=kname, ir_op=ir_op, loc=loc, target=target, emitter=__name__,
             notes=[f"kda prep, Hopper tier (Gluon, sm_90a): H={H} D={D} conv={KW} gate={gate} x:{dtype} "
                    f"q/k/v out:{qkv_dtype} BT={BT} warps={NW} (conv windows from shared memory)"])
    gl_module_head(w)
    with w.gluon_function(kname, sig, const):
        w.lines([
            f"TL: gl.constexpr = gl.BlockedLayout([1, 8], [{32 // LD}, {LD}], [{NW}, 1], [1, 0])",
            "ROW: gl.constexpr = gl.SliceLayout(1, TL)",
            "COL: gl.constexpr = gl.SliceLayout(0, TL)",
            "SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])",
            "pid = gl.program_id(0)",
            "role = pid % 4",
            "nh = (pid // 4) % (N * H)",
            "tb = pid // (4 * N * H)",
            "n = nh // H",
            "h = nh % H",
            "bos = gl.load(cu + n).to(gl.int64)",
            "L = gl.load(cu + n + 1).to(gl.int64) - bos",
            "t0 = tb.to(gl.int64) * BT",
            "rt = t0 + gl.arange(0, BT, layout=ROW).to(gl.int64)",
            "tm = rt < L",
            "rd = gl.arange(0, D, layout=COL)",
            "col = h * D + rd",
        ])
        w.line("if role < 3:")
        with w.indent():
            _emit_conv_role(w, HD, KW, HALO, dtype, qkv_dtype, l2norm_eps)
        w.line("else:")
        with w.indent():
            w.lines([
                f"f = gl.load(xf + (bos + rt)[:, None] * {HD} + col[None, :], mask=tm[:, None], other=0.0)",
                "f = f.to(gl.float32) + gl.load(dt_bias + col)[None, :]",
                "a = gl.exp(gl.load(a_log + h))",
                gl_gate(gate, gate_lower_bound, "f", "a", "g"),
                f"gl.store(gb + (bos + rt)[:, None] * {HD + H} + col[None, :], g, mask=tm[:, None])",
                "bb = gl.load(xb + (bos + rt) * H + h, mask=tm, other=0.0).to(gl.float32)",
                f"gl.store(gb + (bos + rt) * {HD + H} + {HD} + h, _sigmoid(bb), mask=tm)",
            ])
    tier = tier_of("hopper")
    ks = KernelSource(name=kname, source=w.getvalue(), signature=sig, constexprs=const,
                      grid=("cdiv(T_MAX, BT) * N * H * 4",), num_warps=NW, num_stages=1, ir_op=ir_op, loc=loc)
    return replace(ks, tier=tier.name, builds_with=tier.builds_with)


def _emit_conv_role(w: SourceWriter, HD: int, KW: int, HALO: int, dtype: str, qkv_dtype: str,
                    l2norm_eps: float) -> None:
    """A q / k / v program: its rows and the HALO rows before them (x rows inside the segment, conv-tail entries
    before its start, zeros before those) into shared memory once, the KW shifted windows read from there."""
    gdt = {"bf16": "gl.bfloat16", "fp16": "gl.float16", "fp32": "gl.float32"}[dtype]
    prep_role_pointers(w)
    w.lines([
        f"tail_base = (n.to(gl.int64) * {HD} + col) * (KW - 1)",
        f"xm = gl.load(x + (bos + rt)[:, None] * {HD} + col[None, :], mask=tm[:, None], other=0.0)",
        f"rh = t0 - {HALO} + gl.arange(0, {HALO}, layout=ROW).to(gl.int64)",
        "in_seq = (rh >= 0) & (rh < L)",
        "in_tail = (rh < 0) & (rh >= 1 - KW)",
        f"xh = gl.load(x + (bos + rh)[:, None] * {HD} + col[None, :], mask=in_seq[:, None], other=0.0)",
        "xh += gl.load(tin + tail_base[None, :] + (KW - 1 + rh)[:, None], mask=in_tail[:, None], other=0.0)",
        f"buf = gl.allocate_shared_memory({gdt}, [2 * BT, D], SH)",
        f"buf.slice(BT - {HALO}, {HALO}, dim=0).store(xh)",
        "buf.slice(BT, BT, dim=0).store(xm)",
        "gl.barrier()",
        "acc = gl.full([BT, D], 0.0, gl.float32, layout=TL)",
    ])
    # shifted windows by row gather (a subview's offset must be a multiple of its length)
    w.line("rows = gl.arange(0, BT, layout=ROW)[:, None] + gl.full([BT, D], 0, gl.int32, layout=TL)")
    w.line("for j in gl.static_range(KW):")
    with w.indent():
        w.lines([
            "xs = buf.gather(rows + (BT - (KW - 1) + j), 0)",
            "acc += xs.to(gl.float32) * gl.load(wt + col * KW + j).to(gl.float32)[None, :]",
        ])
    w.line(f"acc = {gl_round('acc', dtype)}")
    w.line(f"y = {gl_round('acc * _sigmoid(acc)', dtype)}")
    w.line("if role < 2:")
    w.line(f"    y = y / gl.sqrt(gl.sum(y * y, axis=1) + {fnum(l2norm_eps)})[:, None]")
    w.line(f"gl.store(qkv + (bos + rt)[:, None] * {3 * HD} + role * {HD} + col[None, :], {gl_cast('y', qkv_dtype)}, "
           "mask=tm[:, None])")
    # the program reads only rows before t0 + BT of its own column set, and the first time block is the only writer
    prep_tail_update(w, "gl", HD, KW)


def prep_kernel(num_heads: int, head_dim: int, conv_kernel: int, *, tier: str | None = None,
                interpret: bool | None = None, **kw) -> KernelSource:
    """The prep's kernel of `tier` (None / "portable": emit_kda_prep; "hopper": this module's, opt-in)."""
    if tier == "hopper":
        if interpret:
            raise CodegenError("the hopper KDA prep is a Gluon kernel: the interpreter cannot run it")
        return emit_kda_prep_hopper(num_heads, head_dim, conv_kernel, **kw)
    if tier not in (None, "portable"):
        raise CodegenError(f"KDA prep tier must be portable or hopper, got {tier!r}")
    return emit_kda_prep(num_heads, head_dim, conv_kernel, interpret=interpret, **kw)
