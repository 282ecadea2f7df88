"""The default KDA kernels (K3 shapes: H=96, D=128, bf16) compile for h200 and mi355x without register spills."""
from __future__ import annotations

import pytest

from k3c.codegen.aot import compile_kernels
from k3c.codegen.kernels.kda import emit_kda_decode, emit_kda_inter, emit_kda_intra, kda_plan
from k3c.codegen.targets import get_target


@pytest.mark.parametrize("target", ["h200", "mi355x"])
def test_default_kernels_compile_without_spills(aot_dir, target):
    t = get_target(target)
    gate = dict(gate="safe", gate_lower_bound=-5.0, l2norm_eps=1e-6, target=t, dtype="bf16")
    plan = kda_plan(128, "bf16", t)
    # the kernels with the most state in registers: the two prefill kernels and the decode step (IR path: o out,
    # kda_out follows; fused layer: RMSNorm x gate in the kernel)
    kernels = [emit_kda_intra(96, 128, target=t, qk_dtype="bf16", beta_dtype="bf16", plan=plan),
               emit_kda_inter(96, 128, target=t, v_dtype="bf16", o_dtype="bf16", plan=plan),
               emit_kda_decode(96, 128, 4, norm_eps=1e-5, fuse_out=False, **gate),
               emit_kda_decode(96, 128, 4, norm_eps=1e-5, fuse_out=True, **gate)]
    compiled = compile_kernels(kernels, t, str(aot_dir / target), progress=False)
    for ck in compiled:
        r = ck.resources
        assert not r.has_spills, f"{ck.name}: {r}"
    for ck in compiled:
        if "kda_intra" in ck.name or "kda_inter" in ck.name:
            assert ck.resources.matrix_ops, f"{ck.name} should use the matrix units"
