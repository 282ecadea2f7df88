"""Proof of native code: the grouped MXFP4 expert GEMM compiled ahead of time runs on the MX matrix units where the
target has them (gfx950: v_mfma_scale_f32_*_f8f6f4; sm_100: tcgen05.mma block-scaled, kind::mxf4 with MXFP4
activations, kind::mxf8f6f4 with MXFP8 ones) and upcasts in registers on sm_90 (prmt bit placement, bf16 MMAs),
without spills."""
from __future__ import annotations

import re

import pytest

from k3c.codegen.aot import compile_kernels, shutdown_workers
from k3c.codegen.kernels.moe import emit_moe_gemm, moe_gemm_plan, mx_mode
from k3c.codegen.targets import get_target

N, K, E, TOP_K = 128, 128, 8, 2


@pytest.fixture(scope="module")
def aot_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_aot")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3C_CACHE_DIR", str(root / "cache"))
        yield root
    shutdown_workers()


def compile_expert_gemm(aot_dir, target: str, mx: str, rows: int = 1):
    """The grouped down GEMM (the gate/up kernel has the same main loop, plus a second weight and the GLU)."""
    t = get_target(target)
    plan = moe_gemm_plan("down", N, K, rows, mx, "bf16", t)
    ks = emit_moe_gemm("down", N, K, target=t, plan=plan, num_experts=E, top_k=TOP_K, mx=mx, interpret=False)
    (ck,) = compile_kernels([ks], t, str(aot_dir / f"{target}_{mx}"), progress=False)
    asm = (aot_dir / f"{target}_{mx}" / ck.files["amdgcn" if t.backend == "hip" else "ptx"]).read_text()
    assert not ck.resources.has_spills, ck.resources
    return ck, asm


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


def test_sm90_upcasts_in_registers(aot_dir):
    ck, ptx = compile_expert_gemm(aot_dir, "h200", "upcast")
    assert "prmt.b32" in ptx and "mma.sync" in ptx and ".bf16" in ptx
    assert not re.search(r"tcgen05|mfma_scale", ptx)
