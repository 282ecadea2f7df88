"""The hopper tier's KDA decode on the CPU box: what the plan allows, and that the Gluon source compiles for sm_90a
without spilling (its numerics are a GPU test: tests/kda/test_kda_decode_hopper_gpu.py)."""
from __future__ import annotations

import pytest

from k3c.codegen.aot import compile_kernels
from k3c.codegen.kernels.kda import kda_plan
from k3c.codegen.kernels.kda_decode_hopper import decode_kernel, emit_kda_decode_hopper
from k3c.codegen.targets import get_target
from k3c.codegen.tiers import triton_release
from k3c.codegen.writer import CodegenError

H100 = get_target("h100")
COMMON = dict(gate="safe", gate_lower_bound=-5.0, l2norm_eps=1e-6, norm_eps=1e-5)


def test_the_plan_keeps_the_portable_decode_and_refuses_the_tier_where_it_is_not():
    assert kda_plan(128, "bf16", H100).decode_tier == "portable"
    assert kda_plan(128, "bf16", H100, decode_tier="hopper").decode_tier == "hopper"
    for target in ("cpu", "mi355x"):
        with pytest.raises(CodegenError, match="tier 'hopper' is not available"):
            kda_plan(128, "bf16", get_target(target), decode_tier="hopper")
    with pytest.raises(CodegenError, match="decode_lanes_k must be 8 or 32"):
        kda_plan(128, "bf16", H100, decode_lanes_k=16)


def test_the_dispatcher_and_the_emitter_refuse_what_the_kernel_cannot_do():
    plan = kda_plan(128, "bf16", H100, decode_tier="hopper")
    with pytest.raises(CodegenError, match="interpreter cannot run it"):
        decode_kernel(4, 128, 4, plan=plan, interpret=True, target=H100, **COMMON)
    portable = decode_kernel(4, 128, 4, plan=kda_plan(128, "bf16", H100), target=H100, **COMMON)
    assert portable.tier == "portable" and portable.name.startswith("k3c_kda_decode_fwd")
    with pytest.raises(CodegenError, match="head_dim a power of two >= 32"):
        emit_kda_decode_hopper(4, 16, 4, target=H100, plan=kda_plan(16, "bf16", H100, decode_tier="hopper"),
                               **COMMON)
    narrow = kda_plan(128, "bf16", H100, decode_tier="hopper", decode_block_v=16, decode_warps=8)
    with pytest.raises(CodegenError, match="narrower than"):
        emit_kda_decode_hopper(4, 128, 4, target=H100, plan=narrow, **COMMON)


@pytest.mark.skipif(triton_release() != "3.9", reason="the Gluon source is written for Triton 3.9")
def test_the_gluon_decode_compiles_for_sm90a_without_spills(tmp_path):
    plan = kda_plan(128, "bf16", H100, decode_tier="hopper")
    sources = [decode_kernel(96, 128, 4, plan=plan, target=H100, fuse_out=fuse_out, **COMMON)
               for fuse_out in (False, True)]
    assert all(ks.tier == "hopper" and ks.builds_with == "3.9" for ks in sources)
    for ck in compile_kernels(sources, H100, str(tmp_path), progress=False, keep_asm=False):
        # the slice loop holds two state slices ([128, 32] over 128 threads) and the q, k, decay vectors
        assert ck.resources.spill_count == 0 and ck.resources.regs <= 200, (ck.name, ck.resources.regs_text())
