"""Experimental forms of the grouped MXFP4 expert GEMM that bench/moe.py times against k3c's plans, but that k3c
does not ship (its plans never pick them; docs/perf.md, MoE, records what they measured):

    split      the two-dot upcast form: per 32-block of K, the decoded low / high nibbles (even /
               odd K) meet A's even / odd columns in two half-K dots into the accumulator (no register shuffle
               interleaves the nibbles); 32-K steps at prefill rows (the scaled partial products stay in registers).
    postscale  the split form with fp16 dots of the unscaled decoded values, the fp32 partial product scaled per
               32-block (the weights' scale multiply moves out of the K loop's element work).
    perm       the pair decode from words whose 32 bits were permuted once at load time (pairs_perm_words; the
               canonical k3c.quant layout stays what the IR, the checkpoints and every k3c plan read): 11 integer
               ops per 8 weights instead of 17. Shipping it would need the weight preparation to permute the routed
               experts and the dequant path to read the permuted order.

The kernels reuse k3c's composed parts of emit_moe_gemm (k3c.codegen.kernels.moe: the checked GroupedGemm, the
tile's rows, the K loop driver, the epilogue) with a B operand of their own; `grouped_gemm` launches one as
k3c.runtime.kernel_impls.moe.grouped_gemm launches k3c's.
"""
import dataclasses
import functools
from dataclasses import dataclass

import torch

from k3c.codegen.kernels import moe as KM
from k3c.codegen.kernels.moe_lanes import (E2M1_PAIRS1_PERM_ASM, E2M1_PAIRS1_PERM_OPS,  # noqa: F401 (re-exported)
                                           E2M1_PAIRS_PERM_ASM, E2M1_PAIRS_PERM_OPS, PAIRS_PERM_MASK,
                                           pairs_perm_bit_map, ptx_text)
from k3c.codegen.writer import CodegenError, SourceWriter, ident
from k3c.runtime.devices import target_for, tt_dtype
from k3c.runtime.kernel_impls.moe_layout import perm_words
from k3c.runtime.launcher import launch

FORMS = ("split", "postscale", "perm")


@dataclass(frozen=True)
class FormPlan:
    """A k3c plan (tiles) run in one of FORMS."""
    plan: KM.MoEGemmPlan
    form: str

    @property
    def tag(self) -> str:
        p = self.plan
        name = "pairs" + ("1" if p.one_mul else "") + "p" if self.form == "perm" else self.form
        return f"{name}_m{p.block_m}n{p.block_n}k{p.block_k}w{p.num_warps}s{p.num_stages}"


def form_plan(kind: str, n: int, k: int, rows: int, mx: str, dtype: str, target, form: str, **overrides) -> FormPlan:
    """The plan of `form` at `rows` per expert (moe_gemm_plan overrides as for k3c's plans). perm: a pair-decode plan
    (CUDA, bf16), not swapped. split / postscale: k3c's MMA tiles with 256-K steps at 16 rows, 128 at 32 (a 32 x 256
    step of the split decode spills on sm_90), 32 at 64+ rows."""
    if mx != "upcast" or form not in FORMS:
        raise CodegenError(f"bench forms {FORMS} take upcast MXFP4 weights, got mx {mx!r}, form {form!r}")
    if form == "perm":
        plan = KM.moe_gemm_plan(kind, n, k, rows, mx, dtype, target, **overrides)
        if not plan.pairs or plan.swap:
            raise CodegenError("the perm form takes a pair-decode plan without swap")
        return FormPlan(plan, form)
    bm = KM.row_bucket(rows)
    overrides.setdefault("block_k", 256 if bm == 16 else 128 if bm <= 32 else 32)
    plan = KM.moe_gemm_plan(kind, n, k, rows, mx, dtype, target, gemv=0, pairs=False, dequant=False, **overrides)
    return FormPlan(dataclasses.replace(plan, joined=False, swap=False), form)


def bench_plan(kind: str, n: int, k: int, rows: int, mx: str, dtype: str, target, form: str | None = None, **kw):
    """A bench variant's plan: k3c's (moe_gemm_plan with overrides `kw`), or with `form` a FormPlan."""
    if form is None:
        return KM.moe_gemm_plan(kind, n, k, rows, mx, dtype, target, **kw)
    return form_plan(kind, n, k, rows, mx, dtype, target, form, **kw)


# -- split / postscale: two half-K dots per 32-block ----------------------------------------------------------------
def _split_pointers(w: SourceWriter, g: KM.GroupedGemm) -> None:
    w.line("offs_h = tl.arange(0, 16)")
    w.line("a_ptrs = a_ptr + rows_a[:, None] * K + 2 * offs_h[None, :]  # even K columns of a 32-block")
    for x in g.wn:
        w.line(f"{x}_ptrs = {x}_ptr + e64 * (N * (K // 2)) + rows_w[None, :] * (K // 2) + offs_h[:, None]")
        w.line(f"{x}s_ptrs = {x}s_ptr + e64 * (N * (K // 32)) + rows_w * (K // 32)")


def _split_step(w: SourceWriter, g: KM.GroupedGemm, post_scale: bool) -> None:
    """Per 32-block (its E8M0 scale is per block and column): decoded values (x 2^-14, fp16) times 2^(s - 113) in
    fp32 -> the exact bf16 weights, the dots accumulating straight into acc; or (post_scale) fp16 dots of the
    decoded values and the fp32 partial product scaled per block."""
    pdt = "tl.float32" if (g.interp or g.dt == "fp32") else "tl.float16"       # post_scale dots: fp16 on GPUs
    pkw = ', input_precision="ieee"' if pdt == "tl.float32" else ""
    w.line("for b in tl.static_range(BLOCK_K // 32):")
    with w.indent():
        a_dt = pdt if post_scale else g.op_dt
        w.line(f"a_e = tl.load(a_ptrs + b * 32).to({a_dt})")
        w.line(f"a_o = tl.load(a_ptrs + b * 32 + 1).to({a_dt})")
        for x in g.wn:
            w.lines(KM.e2m1_fp16_lines(f"tl.load({x}_ptrs + b * 16)", "w_lo", "w_hi", True) if g.use_asm else
                    [f"p = tl.load({x}_ptrs + b * 16)"] + KM.e2m1_fp16_lines("p", "w_lo", "w_hi", False))
            w.line(f"sc = (((tl.load({x}s_ptrs + b).to(tl.int32) + 14) << 23)"
                   f".to(tl.float32, bitcast=True))[None, :]")
            if post_scale:
                w.line(f"part = tl.dot(a_e, w_lo.to({pdt}){pkw})")
                w.line(f"part = tl.dot(a_o, w_hi.to({pdt}), part{pkw})")
                w.line(f"acc_{x} += part * sc")
            else:
                w.line(f"acc_{x} = tl.dot(a_e, (w_lo.to(tl.float32) * sc).to({g.op_dt}), acc_{x}{g.dot_kw})")
                w.line(f"acc_{x} = tl.dot(a_o, (w_hi.to(tl.float32) * sc).to({g.op_dt}), acc_{x}{g.dot_kw})")
    w.line("a_ptrs += BLOCK_K")
    for x in g.wn:
        w.line(f"{x}_ptrs += BLOCK_K // 2")
        w.line(f"{x}s_ptrs += BLOCK_K // 32")


# -- perm: the pair decode from load-time permuted words ------------------------------------------------------------
# The op lists, the bit map and the PTX text are k3c's (k3c.codegen.kernels.moe_lanes: the lanes form decodes words in
# this bit order too); this form reads them from the canonical byte order.


def pairs_perm_words(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 payload bytes [..., K/2] (canonical k3c.quant order) -> the same shape with each aligned 4-byte word's
    32 bits permuted into the layout the perm decode reads (k3c's moe_layout.perm_words)."""
    return perm_words(packed)


# -- kernels and launches -------------------------------------------------------------------------------------------
def emit_form_gemm(kind: str, n: int, k: int, *, target, plan: FormPlan, num_experts: int = 1, top_k: int = 1,
                   mx: str = "upcast", dtype: str = "bf16", out_dtype: str | None = None, act: object = "swiglu",
                   name: str | None = None, ir_op: str = "moe_experts", loc: str = "",
                   interpret: bool | None = None):
    """The grouped GEMM kernel of a FormPlan (kernel args as k3c's emit_moe_gemm with MXFP4 weights; perm: the
    payloads in the perm layout)."""
    g = KM.GroupedGemm.checked(kind, n, k, target=target, plan=plan.plan, num_experts=num_experts, top_k=top_k,
                               mx=mx, dtype=dtype, out_dtype=out_dtype, act=act, interpret=interpret)
    if plan.form == "perm":
        if not g.pairs:
            raise CodegenError("a perm plan (packed words in the load-time perm layout) needs the PTX pair decode: "
                               "CUDA, bf16 activations, not the interpreter")
        g = dataclasses.replace(g, pairs_asm=E2M1_PAIRS1_PERM_ASM if g.plan.one_mul else E2M1_PAIRS_PERM_ASM)
        operand, words, suffix = KM.operand_form(g), KM.gemm_form_words(g), "p"
    else:
        post_scale = plan.form == "postscale"
        operand = (_split_pointers, functools.partial(_split_step, post_scale=post_scale))
        words = (" post_scale" if post_scale else "") + KM.gemm_form_words(g)
        suffix = "_ps" if post_scale else ""
    kname = ident(name if name is not None else KM.gemm_kernel_name(g) + suffix)
    w = SourceWriter()
    KM.emit_gemm_preamble(w, g, kname, ir_op, loc, words)
    sig, cx = KM.gemm_kernel_args(g)
    with w.jit_function(kname, list(sig), list(cx)):
        KM.emit_tile_rows(w, g)
        KM.emit_mma_mainloop(w, g, *operand)
        KM.emit_mma_epilogue(w, g)
    return KM.gemm_kernel_source(g, kname, w, sig, cx, ir_op, loc)


def emit_bench_gemm(kind: str, n: int, k: int, *, plan, **kw):
    """emit_form_gemm for a FormPlan, else k3c's emit_moe_gemm."""
    if isinstance(plan, FormPlan):
        return emit_form_gemm(kind, n, k, plan=plan, **kw)
    return KM.emit_moe_gemm(kind, n, k, plan=plan, **kw)


_emit = functools.lru_cache(maxsize=256)(emit_form_gemm)


def grouped_gemm(kind: str, a: torch.Tensor, weights: list[torch.Tensor], off: torch.Tensor, perm: torch.Tensor, *,
                 top_k: int, plan: FormPlan, act=None) -> torch.Tensor:
    """A FormPlan's routed GEMM, as k3c.runtime.kernel_impls.moe.grouped_gemm runs k3c's (weights: packed / scale
    pairs; perm plans take the payloads through pairs_perm_words)."""
    el, n, k = weights[0].shape[0], weights[0].shape[1], a.shape[-1]
    S = a.shape[0] * top_k if kind == "gate_up" else a.shape[0]
    interp = a.device.type == "cpu"
    ks = _emit(kind, n, k, target=target_for(a.device), plan=plan, num_experts=el, top_k=top_k,
               dtype=tt_dtype(a.dtype), out_dtype=tt_dtype(a.dtype), act=act if kind == "gate_up" else None,
               ir_op=f"moe_{kind}", interpret=interp)
    out = torch.empty(S, n, dtype=a.dtype, device=a.device)
    bm = plan.plan.block_m
    # the interpreter pays for every program: the exact tile count; a GPU takes the bound (no host sync)
    tiles = int(off[1 + KM.ROW_BUCKETS.index(bm), -1]) if interp else KM.tile_slots(S, el, bm)
    launch(ks, a.contiguous(), *[t.contiguous() for t in weights], off, perm, out, tiles)
    return out
