"""The hopper tier's KDA prep on the CPU box: what it refuses, and that the Gluon source compiles for sm_90a without
spilling, reading the conv windows from shared memory (its numerics are a GPU test:
tests/kda/test_kda_decode_hopper_gpu.py, which builds the prep's binaries too)."""
from __future__ import annotations

import re

import pytest

from k3c.codegen.aot import compile_kernels
from k3c.codegen.kernels.kda_prep_hopper import emit_kda_prep_hopper, prep_kernel
from k3c.codegen.targets import get_target
from k3c.codegen.tiers import triton_release
from k3c.codegen.writer import CodegenError

H100 = get_target("h100")
COMMON = dict(gate="safe", gate_lower_bound=-5.0, l2norm_eps=1e-6)


def test_the_dispatcher_keeps_the_portable_prep_and_refuses_what_the_tier_cannot_do():
    assert prep_kernel(4, 128, 4, target=H100, **COMMON).tier == "portable"
    assert prep_kernel(4, 128, 4, tier="hopper", target=H100, **COMMON).tier == "hopper"
    with pytest.raises(CodegenError, match="interpreter cannot run it"):
        prep_kernel(4, 128, 4, tier="hopper", interpret=True, target=H100, **COMMON)
    with pytest.raises(CodegenError, match="portable or hopper"):
        prep_kernel(4, 128, 4, tier="gfx950", target=H100, **COMMON)
    for target, d, bt in (("cpu", 128, 32), ("mi355x", 128, 32), ("h100", 16, 32), ("h100", 128, 2)):
        with pytest.raises(CodegenError, match="hopper KDA prep: needs"):
            emit_kda_prep_hopper(4, d, 4, target=get_target(target), block_t=bt, **COMMON)


@pytest.mark.skipif(triton_release() != "3.9", reason="the Gluon source is written for Triton 3.9")
def test_the_gluon_prep_compiles_for_sm90a_with_its_windows_from_shared_memory(tmp_path):
    ks = prep_kernel(96, 128, 4, tier="hopper", target=H100, qkv_dtype="bf16", block_t=32, **COMMON)
    assert ks.builds_with == "3.9"
    (ck,) = compile_kernels([ks], H100, str(tmp_path), progress=False)
    assert ck.resources.spill_count == 0 and ck.resources.regs <= 160, ck.resources.regs_text()
    ptx = (tmp_path / f"{ck.name}.ptx").read_text()
    # each row is read from global memory once (plus the halo) and the four taps come from shared memory
    assert len(re.findall(r"ld\.shared", ptx)) >= 4 and len(re.findall(r"bar\.sync", ptx)) <= 2
