"""Proof of native code: the grouped MXFP4 expert GEMM compiled ahead of time runs on the MX matrix units where the
target has them (gfx950: v_mfma_scale_f32_*_f8f6f4; sm_100: tcgen05.mma block-scaled, kind::mxf4 with MXFP4
activations, kind::mxf8f6f4 with MXFP8 ones) and upcasts in registers on sm_90 (prmt bit placement; bf16 MMAs fed
by the PTX pair decode at decode rows, a dequant kernel + bf16 wgmma GEMM at prefill rows), without spills."""
from __future__ import annotations

import re

import pytest

from k3c.codegen.aot import compile_kernels
from k3c.codegen.kernels.moe import emit_moe_dequant, emit_moe_gemm, moe_gemm_plan, mx_mode
from k3c.codegen.targets import get_target

N, K, E, TOP_K = 128, 128, 8, 2


def compile_expert_gemm(aot_dir, target: str, mx: str, rows: int = 1):
    """The grouped down GEMM (the gate/up kernel has the same main loop, plus a second weight and the GLU)."""
    t = get_target(target)
    plan = moe_gemm_plan("down", N, K, rows, mx, "bf16", t)
    ks = [emit_moe_gemm("down", N, K, target=t, plan=plan, num_experts=E, top_k=TOP_K, interpret=False,
                        mx="none" if plan.dequant else mx, w_dtype="bf16" if plan.dequant else None,
                        expert_chunk=plan.dequant)]
    if plan.dequant:
        ks.append(emit_moe_dequant(N, K, target=t, interpret=False))
    out = aot_dir / f"{target}_{mx}_{rows}"
    cks = compile_kernels(ks, t, str(out), progress=False)
    asm = "\n".join((out / ck.files["amdgcn" if t.backend == "hip" else "ptx"]).read_text() for ck in cks)
    assert not any(ck.resources.has_spills for ck in cks), [ck.resources for ck in cks]
    return cks[0], asm


def test_mode_follows_the_target():
    assert mx_mode("mxfp4", get_target("mi355x"), "mxfp8") == "e4m3"
    assert mx_mode("mxfp4", get_target("b200"), "mxfp4") == "e2m1"
    assert mx_mode("mxfp4", get_target("h200"), "mxfp8") == "upcast"
    assert mx_mode("mxfp4", get_target("mi300x"), "mxfp8") == "upcast"
    assert mx_mode("mxfp4", get_target("mi355x"), "bf16") == "upcast"    # bf16 activations stay bf16
    assert mx_mode("bf16", get_target("mi355x"), "mxfp8") == "none"


def test_gfx950_runs_scaled_mfma(aot_dir):
    _, asm = compile_expert_gemm(aot_dir, "mi355x", "e4m3")
    assert re.search(r"v_mfma_scale_f32_\w+_f8f6f4", asm)


def test_sm100_runs_block_scaled_tcgen05_mxf4(aot_dir):
    """MXFP4 activations x MXFP4 weights (MXFP8 activations give kind::mxf8f6f4, also block-scaled)."""
    _, ptx = compile_expert_gemm(aot_dir, "b200", "e2m1", rows=128)
    assert re.search(r"tcgen05\.mma\S*\.kind::mxf4\.block_scale", ptx), "no block-scaled tcgen05.mma kind::mxf4"


@pytest.mark.parametrize("rows, mma", [(1, "mma.sync"), (16, "mma.sync"), (512, "wgmma")])
def test_sm90_upcasts_in_registers(aot_dir, rows, mma):
    """Default forms by rows: 1-16 the joined MMA form with the pair decode (bf16x2 multiplies), 512 dequant + bf16
    wgmma. (The FMA GEMV form, the default without the pair decode: test_moe_kernels, bench --decode "old".)"""
    ck, ptx = compile_expert_gemm(aot_dir, "h200", "upcast", rows)
    assert "prmt.b32" in ptx and not re.search(r"tcgen05|mfma_scale", ptx)
    assert mma in ptx and ".bf16" in ptx
    assert ("mul.rn.bf16x2" in ptx) == (rows <= 16)


def test_sm90_pair_decode_plans_at_k3_shapes(aot_dir):
    """The decode-row default on sm_90 (pair decode, one multiply; the exact two-multiply fallback; swap) at K3 expert
    shapes: bf16x2 multiplies and mma.sync, no fp16 decode, no spills. (The perm decode of bench/moe_forms.py:
    test_bench_moe_forms.py.)"""
    t = get_target("h200")
    ks = []
    # swap at the 1-warp 64-K tile it was measured with (at 4 warps the swapped down tile may take wgmma instead)
    for tag, kw in (("one", {}), ("exact", dict(one_mul=False)),
                    ("swap", dict(swap=True, num_warps=1, block_k=64, num_stages=4))):
        for kind, n, k in (("gate_up", 3072, 3584), ("down", 3584, 3072)):
            plan = moe_gemm_plan(kind, n, k, 1, "upcast", "bf16", t, **kw)
            assert plan.pairs and plan.one_mul == (tag != "exact")
            ks.append(emit_moe_gemm(kind, n, k, target=t, plan=plan, num_experts=896, top_k=16, mx="upcast",
                                    act="swiglu" if kind == "gate_up" else None, interpret=False))
    cks = compile_kernels(ks, t, str(aot_dir / "h200_pairs"), progress=False)
    for ck in cks:
        ptx = (aot_dir / "h200_pairs" / ck.files["ptx"]).read_text()
        assert not ck.resources.has_spills, (ck.name, ck.resources)
        assert "mul.rn.bf16x2" in ptx and "mma.sync" in ptx and "cvt.f32.f16" not in ptx, ck.name


def test_gfx950_upcast_decode_plans_at_k3_shapes(aot_dir):
    """gfx950 with bf16 activations upcasts too (no pair decode off CUDA): the decode-row defaults and the swap form
    compile without spills."""
    t = get_target("mi355x")
    ks = []
    for tag, rows, kw in (("gemv", 1, {}), ("joined", 2, {}), ("swap", 2, dict(swap=True))):
        for kind, n, k in (("gate_up", 3072, 3584), ("down", 3584, 3072)):
            plan = moe_gemm_plan(kind, n, k, rows, "upcast", "bf16", t, **kw)
            assert not plan.pairs and plan.swap == (tag == "swap")
            ks.append(emit_moe_gemm(kind, n, k, target=t, plan=plan, num_experts=896, top_k=16, mx="upcast",
                                    act="swiglu" if kind == "gate_up" else None, interpret=False))
    cks = compile_kernels(ks, t, str(aot_dir / "mi355x_decode"), progress=False)
    assert not [ck.resources for ck in cks if ck.resources.has_spills]
