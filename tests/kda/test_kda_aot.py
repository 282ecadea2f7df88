"""The default KDA kernels (K3 shapes: H=96, D=128, bf16) compile for h200 and mi355x without register spills."""
from __future__ import annotations

import pytest

from k3c.codegen.aot import compile_kernels, shutdown_workers
from k3c.codegen.kernels.kda import emit_kda_chunk, emit_kda_decode, kda_plan
from k3c.codegen.targets import get_target


@pytest.fixture(scope="module")
def aot_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("kda_aot")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3C_CACHE_DIR", str(root / "cache"))
        yield root
    shutdown_workers()


@pytest.mark.parametrize("target", ["h200", "mi355x"])
def test_default_kernels_compile_without_spills(aot_dir, target):
    t = get_target(target)
    gate = dict(gate="safe", gate_lower_bound=-5.0, l2norm_eps=1e-6, target=t, dtype="bf16")
    plan = kda_plan(128, "bf16", t)
    # the two kernels with the most state in registers (the rest are checked in docs/perf.md's table)
    kernels = [emit_kda_chunk(96, 128, target=t, plan=plan),                                      # the IR path
               emit_kda_decode(96, 128, 4, norm_eps=1e-5, fuse_out=False, **gate)]                # V split
    compiled = compile_kernels(kernels, t, str(aot_dir / target), progress=False)
    for ck in compiled:
        r = ck.resources
        assert not r.has_spills, f"{ck.name}: {r}"
    chunk = next(ck for ck in compiled if "kda_chunk" in ck.name)
    assert chunk.resources.matrix_ops, "the chunk kernel should use the matrix units"
