"""The hopper layout of routed MXFP4 experts (k3c.codegen.kernels.moe_hopper, k3c.runtime.expert_layout) and
the grouped GEMM form that reads it: the layout as its definition says and as a bit-exact round trip against
k3c.quant's (OCP) layout; the decode's PTX op list run in Python with PTX semantics over the kernel's own reorder and
scale layout (bit for bit the dequantized weights); the kernels through the Triton interpreter against the reference
routed experts (gate_up with the GLU fused, down, combine); the plan; the target's choice at lowering and weight
preparation (and the reference reading the prepared stacks back); the sm_90 cross-compile (spill-free, wgmma with the
decoded weights as the register A operand)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from k3c import reference as ref
from k3c.codegen.kernels import moe as KM
from k3c.codegen.kernels import moe_hopper as KH
from k3c.codegen.kernels.moe import GroupedGemm, emit_moe_gemm, moe_gemm_plan
from k3c.codegen.targets import get_target
from k3c.codegen.writer import CodegenError
from k3c.quant import mxfp4_dequantize, mxfp4_quantize
from k3c.runtime.kernel_impls import moe as M
from k3c.runtime.expert_layout import from_hopper, from_hopper_scales, to_hopper, to_hopper_scales

from .test_moe_kernels import SITU, rel
from .test_moe_pairs_decode import _bf16x2_mul, run_ops

K3_SHAPES = (("gate_up", 3072, 3584), ("down", 3584, 3072))


# ---- 1. the layouts: definition and round trip --------------------------------------------------------------------
def test_value_layout_is_its_definition():
    """Stored [N/4, 2K] row 4 B + s, column 128 t + 64 p + 16 c + 4 j + 2 i + h holds canonical (16 B + 8 h + 2 s
    + p, 32 t + 8 j + 4 i + c) (before the bit step: bytes whose words are all equal keep their bits)."""
    n, kb = 32, 64
    from k3c.runtime.expert_layout import _values_to

    idx = torch.arange(n * kb).reshape(1, n, kb)
    stored = _values_to(idx, False)[0].reshape(n // 4, 4 * kb)
    for row in range(n):
        b, r = divmod(row, 16)
        h, r = divmod(r, 8)
        s, p = divmod(r, 2)
        for col in range(kb):
            t, r = divmod(col, 32)
            j, r = divmod(r, 8)
            i, c = divmod(r, 4)
            assert stored[4 * b + s, 128 * t + 64 * p + 16 * c + 4 * j + 2 * i + h] == row * kb + col


def test_scale_layout_is_its_definition():
    from k3c.runtime.expert_layout import _scales_to

    n, kc = 32, 6
    idx = torch.arange(n * kc).reshape(1, n, kc)
    stored = _scales_to(idx, False)[0].reshape(n // 16, 16 * kc)
    for row in range(n):
        r_, r = divmod(row, 16)
        h, g = divmod(r, 8)
        for col in range(kc):
            m, a = divmod(col, 2)
            assert stored[r_, 32 * m + 4 * g + 2 * a + h] == row * kc + col


@pytest.mark.parametrize("shape", [(2, 16, 32), (3, 48, 96), (2, 2, 32, 64)])
def test_hopper_round_trip_is_bit_exact(shape):
    """to_hopper / from_hopper (payload) and the scale pair are inverses, bit for bit, in and out of place; not the
    identity; shapes and dtypes kept."""
    g = torch.Generator().manual_seed(sum(shape))
    p = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, shape[:-1] + (shape[-1] // 16,), dtype=torch.uint8, generator=g)
    for fwd, back, t in ((to_hopper, from_hopper, p), (to_hopper_scales, from_hopper_scales, s)):
        keep = t.clone()
        stored = fwd(t)
        assert stored.shape == t.shape and stored.dtype == torch.uint8 and torch.equal(t, keep)
        assert not torch.equal(stored, t)
        assert torch.equal(back(stored), t)
        q = t.clone()
        assert fwd(q, in_place=True) is q and torch.equal(q, stored)
        assert back(q, in_place=True) is q and torch.equal(q, t)


def test_hopper_round_trip_of_quantized_weights_and_slabs(monkeypatch):
    """From k3c.quant's MXFP4 (the OCP layout) to the hopper layout and back: the same bytes; slab-wise rewriting
    (bounded temporaries) gives the same bytes as one slab."""
    from k3c.runtime import expert_layout

    w = torch.randn(5, 32, 128, generator=torch.Generator().manual_seed(1))
    p, s = mxfp4_quantize(w)
    stored, sstored = to_hopper(p), to_hopper_scales(s)
    assert torch.equal(mxfp4_dequantize(from_hopper(stored), from_hopper_scales(sstored), torch.float32),
                       mxfp4_dequantize(p, s, torch.float32))
    monkeypatch.setattr(expert_layout, "_SLAB_BYTES", 32 * 64 * 8 * 2)       # two experts per slab, the last partial
    assert torch.equal(to_hopper(p), stored) and torch.equal(to_hopper_scales(s), sstored)
    assert torch.equal(from_hopper(stored), p)


@pytest.mark.parametrize("fn, last", [(to_hopper, 32), (from_hopper, 32), (to_hopper_scales, 2),
                                      (from_hopper_scales, 2)])
def test_hopper_layout_rejects_bad_stacks(fn, last):
    with pytest.raises(ValueError, match="hopper layout"):
        fn(torch.zeros(2, 24, last, dtype=torch.uint8))               # N not a multiple of 16
    with pytest.raises(ValueError, match="hopper layout"):
        fn(torch.zeros(2, 16, last + last // 2, dtype=torch.uint8))   # K not a multiple of 64
    with pytest.raises(ValueError, match="hopper layout"):
        fn(torch.zeros(2, 16, last, dtype=torch.int32))
    with pytest.raises(ValueError, match="hopper layout"):
        fn(torch.zeros(2, 16, 2 * last, dtype=torch.uint8).transpose(-1, -2)[..., :last], in_place=True)


# ---- 2. the decode as the kernel applies it, with PTX semantics ---------------------------------------------------
def _kernel_tile(stored_p, stored_s, one_mul: bool):
    """What one program's K steps compute for a whole [N, K] stack (a single N tile, BLOCK_K = K): the stored words
    decoded by the op list, the kernel's reorder of (byte x 2 + nibble) and of the scales, the bf16x2 scale multiply:
    int64 bf16 bit patterns [N, K]."""
    n, kb = stored_p.shape
    k = 2 * kb
    words = (stored_p.to(torch.int64).reshape(n // 4, kb, 4) << torch.tensor([0, 8, 16, 24])).sum(-1)
    out = run_ops(KH.HOPPER_DECODE_OPS if one_mul else KH.HOPPER_DECODE_EXACT_OPS, {"$4": words.reshape(-1)})
    regs = torch.stack([out[f"${j}"] for j in range(4)], dim=-1).reshape(n // 4, kb, 4)
    vals = torch.stack([regs & 0xFFFF, regs >> 16], dim=-1).reshape(n // 4, 4 * k)       # byte x 2 + nibble
    vals = vals.reshape(n // 16, 4, k // 64, 2, 4, 4, 2, 2, 2).permute(KH._VALUE_ORDER).reshape(n, k)
    s = stored_s.to(torch.int64).reshape(n // 16, k // 64, 8, 2, 2).permute(KH._SCALE_ORDER).reshape(n, k // 32)
    mult = (s + 126) << 7 if one_mul else torch.where(s == 0, 0x40, s << 7)
    mult = mult.repeat_interleave(32, dim=1)
    return _bf16x2_mul(vals | (vals << 16), mult | (mult << 16)) & 0xFFFF


@pytest.mark.parametrize("one_mul, top", [(True, KM.PAIRS1_MAX_SCALE), (False, 254)])
def test_decode_of_stored_tiles_is_the_dequantized_stack(one_mul, top):
    """Every byte value at every position of a 64-K chunk and scales over the whole range the plan takes (0 and the
    top included): the kernel's decode + reorder + scale gives k3c.quant's bf16 dequantization bit for bit."""
    g = torch.Generator().manual_seed(7)
    n, kb = 256, 64
    canon = ((torch.arange(256)[:, None] + 37 * torch.arange(kb)) % 256).to(torch.uint8)
    scales = torch.randint(0, top + 1, (n, kb // 16), generator=g)
    scales[:4, 0] = torch.tensor([0, 1, 127, top])
    scales = scales.to(torch.uint8)
    got = _kernel_tile(to_hopper(canon[None])[0], to_hopper_scales(scales[None])[0], one_mul)
    want = mxfp4_dequantize(canon, scales, torch.bfloat16).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(got, want)


def test_decode_asm_text_is_the_ops():
    for ops, text, muls in ((KH.HOPPER_DECODE_OPS, KH.HOPPER_DECODE_ASM, 0),
                            (KH.HOPPER_DECODE_EXACT_OPS, KH.HOPPER_DECODE_EXACT_ASM, 4)):
        assert text.count(";") == len(ops) + 1 and text.count("prmt.b32") == 4 and text.count("and.b32") == 4
        assert text.count("shf.r.wrap.b32") == 2 and text.count("mul.rn.bf16x2") == muls


# ---- 3. the kernels through the interpreter -----------------------------------------------------------------------
def _case(t=7, e=6, k=3, z=128, m=64, seed=5, gain=None):
    g = torch.Generator().manual_seed(seed)
    wt, ids, off, perm = M.route(torch.randn(t, e, generator=g), None, top_k=k)
    x = torch.randn(t, z, generator=g).to(torch.bfloat16)
    ws = [torch.randn(*s, generator=g) / s[-1] ** 0.5 for s in ((e, m, z), (e, m, z), (e, z, m))]
    if gain is not None:
        ws = [w * gain.view(-1, 1, 1) for w in ws]
    return (t, e, k, z, m), (wt, ids, off, perm), x, [mxfp4_quantize(w) for w in ws]


def _run(x, qs, routing, dims, plans, layout="hopper"):
    wt, ids, off, perm = routing
    _, e, k, _, _ = dims
    h = M.grouped_gemm("gate_up", x, [*qs[0], *qs[1]], off, perm, top_k=k, mx="upcast", act=SITU, plan=plans[0],
                       layout=layout)
    y = M.grouped_gemm("down", h, [*qs[2]], off, perm, top_k=k, mx="upcast", plan=plans[1], layout=layout)
    return M.combine(y, wt, ids, top_k=k, num_experts=e)


def _hopper(qs):
    return [(to_hopper(p), to_hopper_scales(s)) for p, s in qs]


def test_hopper_experts_equal_reference():
    """7 tokens over 6 experts (top-3): gate_up in four N tiles of 32 rows per weight (ragged experts), down in one
    128-row tile over two 64-K steps; the default plans (None: the layout picks the hopper form) too. Canonical
    payloads through the same kernels are something else entirely (the layout is read)."""
    dims, routing, x, qs = _case(m=128)
    t, e, k, z, m = dims
    want = ref.routed_experts(x, *(mxfp4_dequantize(p, s, torch.bfloat16) for p, s in qs), routing[0],
                              routing[1].long(), SITU)
    cpu = get_target("cpu")
    rows = -(-t * k // e)
    plans = (moe_gemm_plan("gate_up", m, z, rows, "upcast", "bf16", cpu, hopper=True, block_n=32),
             moe_gemm_plan("down", z, m, rows, "upcast", "bf16", cpu, hopper=True, block_k=64))
    assert plans[1].block_k == 64 and m // plans[1].block_k == 2 and m // plans[0].block_n == 4
    hq = _hopper(qs)
    got = _run(x, hq, routing, dims, plans)
    assert rel(got, want) <= 5e-3
    assert torch.equal(_run(x, hq, routing, dims, (None, None)), _run(x, hq, routing, dims, (
        moe_gemm_plan("gate_up", m, z, rows, "upcast", "bf16", cpu, hopper=True),
        moe_gemm_plan("down", z, m, rows, "upcast", "bf16", cpu, hopper=True))))
    assert rel(_run(x, qs, routing, dims, plans), want) > 0.5
    with pytest.raises(CodegenError, match="hopper"):       # a plan of another form cannot read the layout
        _run(x, hq, routing, dims, (moe_gemm_plan("gate_up", m, z, rows, "upcast", "bf16", cpu), None))


def test_hopper_experts_fp32_activations():
    """fp32 activations (an fp32 run): the hopper form's portable decode and fp32 dots, to fp32 accuracy."""
    dims, routing, x, qs = _case(t=3, m=64)
    x = x.float()
    want = ref.routed_experts(x, *(mxfp4_dequantize(p, s, torch.float32) for p, s in qs), routing[0],
                              routing[1].long(), SITU)
    g = GroupedGemm.checked("down", 128, 64, target=get_target("h100"), plan=moe_gemm_plan(
        "down", 128, 64, 1, "upcast", "fp32", get_target("h100"), hopper=True), mx="upcast", dtype="fp32",
        num_experts=6, top_k=3, interpret=False)
    assert g.hopper and g.hopper_asm is None                  # no PTX decode for fp32: the portable one
    assert rel(_run(x, _hopper(qs), routing, dims, (None, None)), want) <= 1e-5


def test_hopper_exact_plan_on_large_scales():
    """Scales above PAIRS1_MAX_SCALE: the runtime's scale check swaps the one-multiply plan for the exact one (still
    the hopper form), which matches the reference."""
    dims, routing, x, qs = _case(t=3, seed=8, gain=torch.tensor([1.0, 64.0, 1.0, 128.0, 1.0, 1.0]))
    t, e, k, z, m = dims
    assert int(max(s.max() for _, s in qs)) > KM.PAIRS1_MAX_SCALE and not M.scales_fit_one_mul([qs[0][1]])
    cpu = get_target("cpu")
    swapped = KM.expert_plan("down", z, m, 1, target=cpu, mx="upcast", dtype="bf16", one_mul_fits=False,
                             hopper=True)
    assert swapped.hopper and not swapped.one_mul and swapped.tag.startswith("hopper_")
    want = ref.routed_experts(x, *(mxfp4_dequantize(p, s, torch.bfloat16) for p, s in qs), routing[0],
                              routing[1].long(), SITU)
    assert rel(_run(x, _hopper(qs), routing, dims, (None, None)), want) <= 5e-3


# ---- 4. the plan --------------------------------------------------------------------------------------------------
def test_hopper_plan_over_rows():
    h100 = get_target("h100")
    for kind, n, k in K3_SHAPES:
        for rows, bm in ((1, 16), (16, 16), (17, 32), (64, 64), (300, 128), (5000, 128)):
            p = moe_gemm_plan(kind, n, k, rows, "upcast", "bf16", h100, hopper=True)
            gate_up = kind == "gate_up"
            # gate_up: 64-row tiles from 64 rows per expert, 2 x 256 weight rows at 64 (docs/perf.md issue 54)
            assert p.hopper and p.one_mul and p.block_m == (min(bm, 64) if gate_up else bm), p
            assert p.tag.startswith("hopper1") and p.block_k == 128 and 2 <= p.num_stages <= 4
            assert p.num_warps == (4 if bm == 16 else 8)
            assert p.block_n == (256 if not gate_up or bm == 64 else 128)
            assert p.block_n % KH.HOPPER_ROWS == 0 and not (p.dequant or p.joined or p.lanes or p.gemv)
            g = GroupedGemm.checked(kind, n, k, target=h100, plan=p, num_experts=128, top_k=16, mx="upcast",
                                    act=SITU if kind == "gate_up" else None, interpret=False)
            assert g.hopper and g.swap and g.hopper_asm == KH.HOPPER_DECODE_ASM
            g = GroupedGemm.checked(kind, n, k, target=h100, plan=dataclasses.replace(p, one_mul=False),
                                    num_experts=128, top_k=16, mx="upcast", act=SITU if kind == "gate_up" else None,
                                    interpret=False)
            assert g.hopper_asm == KH.HOPPER_DECODE_EXACT_ASM
        assert not moe_gemm_plan(kind, n, k, 1, "upcast", "bf16", h100).hopper      # canonical weights: never


def test_hopper_plans_refused():
    h100 = get_target("h100")
    with pytest.raises(CodegenError):
        moe_gemm_plan("down", 120, 128, 1, "upcast", "bf16", h100, hopper=True)       # N not a multiple of 16
    with pytest.raises(CodegenError):
        moe_gemm_plan("down", 128, 96, 1, "upcast", "bf16", h100, hopper=True)        # K not a multiple of 64
    with pytest.raises(CodegenError):
        moe_gemm_plan("down", 128, 128, 1, "upcast", "fp16", h100, hopper=True)
    ok = moe_gemm_plan("down", 128, 192, 1, "upcast", "bf16", h100, hopper=True)
    assert ok.block_k == 64                                       # 128 does not divide 192: the largest that does
    kw = dict(num_experts=4, top_k=2, mx="upcast", interpret=False)
    emit_moe_gemm("down", 128, 192, target=h100, plan=ok, **kw)
    with pytest.raises(CodegenError):
        emit_moe_gemm("down", 128, 192, target=h100, plan=dataclasses.replace(ok, block_n=24), **kw)
    with pytest.raises(CodegenError):
        emit_moe_gemm("dense", 128, 192, target=h100, plan=ok, mx="upcast", interpret=False)
    with pytest.raises(CodegenError, match="hip"):
        emit_moe_gemm("down", 128, 192, target=get_target("mi300x"), plan=ok, **kw)


# ---- 5. chosen by the target: lowering, weight preparation, the reference reading it back ---------------------------
def test_targets_choose_the_layout():
    from k3c.runtime.weight_prep import expert_layout

    assert expert_layout(get_target("h100")) == expert_layout(get_target("h200")) == "hopper"
    for name in ("mi355x", "b200", "mi300x", "cpu"):
        assert expert_layout(get_target(name)) == "canonical"


def test_lowering_for_hopper_targets_marks_prepares_and_reads_back():
    """moe-lower for h200 gives the grouped GEMMs expert_layout "hopper" (mi355x / b200 / the default: not);
    prepare_weights rewrites exactly those stacks (new tensors, marked: preparing again changes nothing), from which
    the generated kernels (interpreter) and the torch reference both give the reference MoE; the catalogue's
    kernels for those ops are the hopper form's."""
    from k3c.codegen.catalogue import EMITTERS
    from k3c.ir import parse_module, print_module
    from k3c.passes import run_pipeline
    from k3c.runtime.executor import LayerCaches, build_graph_module
    from k3c.runtime.weight_prep import in_hopper_layout, prepare_weights

    from .test_moe_lower import moe_module, reference

    kw = dict(latent=True, act="situ", dtype=torch.bfloat16, fmt="mxfp4", z=64, m=64, d=32)
    module, weights, ref_w = moe_module(**kw)
    for target in ("mi355x", "b200", None):
        low, _ = run_pipeline(module, ["moe-lower", "codegen"], target=target)
        assert all(op.attr("expert_layout", "canonical") == "canonical" for op in low.ops)
    low, records = run_pipeline(module, ["moe-lower", "codegen"], target="h200")
    assert records[0].counts.get("hopper_layout") == 1
    grouped = [op for op in low.ops if op.op in ("moe_gate_up", "moe_down")]
    assert len(grouped) == 2 and all(op.attr("expert_layout") == "hopper" for op in grouped)
    assert parse_module(print_module(low)) == low
    prepared = prepare_weights(low, weights)
    stacks = [n for n in weights if ".experts." in n]
    assert len(stacks) == 6
    for n in stacks:
        assert in_hopper_layout(prepared[n]) and not in_hopper_layout(weights[n])
        back = from_hopper(prepared[n]) if n.endswith("weight_packed") else from_hopper_scales(prepared[n])
        assert torch.equal(back, weights[n]) and not torch.equal(prepared[n], weights[n])
    again = prepare_weights(low, prepared)
    assert all(again[n] is prepared[n] for n in stacks)
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = reference(kw, ref_w, x)
    assert rel(build_graph_module(low, prepared, use_kernels=True)(x, LayerCaches(2)), want) <= 1e-2
    assert rel(build_graph_module(low, prepared, use_kernels=False)(x, LayerCaches(2)), want) <= 1e-2
    h200 = get_target("h200")
    for op in grouped:
        names = [ks.name for ks in EMITTERS[op.op](op, low, h200)]
        assert names and all("_hp" in n for n in names), names


# ---- 6. the sm_90 cross-compile --------------------------------------------------------------------------------------
def test_hopper_kernels_compile_spill_free_for_sm90(aot_dir):
    """K3 expert shapes (896 experts, top-16, SiTU), the decode (rows 1) and prefill (rows 128) classes of the
    catalogue: spill-free, wgmma with the decoded weights as the register A operand (a #ttg.dot_op opIdx 0 tensor, not
    a shared-memory descriptor), the perm decode (rotates, prmt) and the bf16x2 scale multiplies. (All 16 classes,
    rows 16-128 x both decodes, compile spill-free: docs/perf.md, issue 54.)"""
    from k3c.codegen.aot import compile_kernels

    h200 = get_target("h200")
    ks = []
    for rows in (1, 128):
        for kind, n, k in K3_SHAPES:
            plan = KM.expert_plan(kind, n, k, rows, target=h200, mx="upcast", dtype="bf16", hopper=True)
            ks.append(emit_moe_gemm(kind, n, k, target=h200, plan=plan, num_experts=896, top_k=16, mx="upcast",
                                    act=SITU if kind == "gate_up" else None, interpret=False))
    out = aot_dir / "h200_hopper"
    cks = compile_kernels(ks, h200, str(out), progress=False, cache=False)
    assert len(cks) == 4
    for ck in cks:
        assert "_hp1" in ck.name and not ck.resources.has_spills, (ck.name, ck.resources)
        ptx = (out / ck.files["ptx"]).read_text()
        assert "wgmma" in ptx and "shf.r.wrap" in ptx and "prmt.b32" in ptx, ck.name
        ttgir = (out / ck.files["ttgir"]).read_text()
        dots = [ln for ln in ttgir.splitlines() if re.search(r"\bttng\.warp_group_dot\b", ln)]
        assert dots, ck.name
        for ln in dots:
            a = re.search(r" : ((?:tensor|!ttg\.memdesc)<.*?) \* ", ln).group(1)
            assert re.search(r"#ttg\.dot_op<\{opIdx = 0", a) and "!ttg.memdesc" not in a, (ck.name, ln)
