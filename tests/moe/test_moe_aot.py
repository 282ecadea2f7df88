"""Proof of native code: the grouped MXFP4 expert GEMM compiled ahead of time runs on the MX matrix units where the
target has them (gfx950: v_mfma_scale_f32_*_f8f6f4; sm_100: tcgen05.mma block-scaled, kind::mxf4 with MXFP4
activations, kind::mxf8f6f4 with MXFP8 ones) and upcasts in registers on sm_90 (prmt bit placement, bf16 MMAs),
without spills."""
from __future__ import annotations

import re

import pytest

from k3c.codegen.aot import compile_kernels, shutdown_workers
from k3c.codegen.kernels.common import GluAct
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


def compile_gate_up(aot_dir, target: str, mx: str, rows: int = 1):
    t = get_target(target)
    plan = moe_gemm_plan("gate_up", N, K, rows, mx, "bf16", t)
    ks = emit_moe_gemm("gate_up", N, K, target=t, plan=plan, num_experts=E, top_k=TOP_K, mx=mx,
                       act=GluAct("situ"), interpret=False)
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
    _, asm = compile_gate_up(aot_dir, "mi355x", "e4m3")
    assert re.search(r"v_mfma_scale_f32_\w+_f8f6f4", asm)


@pytest.mark.parametrize("mx, kind", [("e2m1", "mxf4"), pytest.param("e4m3", "mxf8f6f4", marks=pytest.mark.slow)])
def test_sm100_runs_block_scaled_tcgen05(aot_dir, mx, kind):
    _, ptx = compile_gate_up(aot_dir, "b200", mx, rows=128)
    assert re.search(rf"tcgen05\.mma\S*\.kind::{kind}\.block_scale", ptx), "no block-scaled tcgen05.mma"


def test_sm90_upcasts_in_registers(aot_dir):
    ck, ptx = compile_gate_up(aot_dir, "h200", "upcast")
    assert "prmt.b32" in ptx and "mma.sync" in ptx and ".bf16" in ptx
    assert not re.search(r"tcgen05|mfma_scale", ptx)
