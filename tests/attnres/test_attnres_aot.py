"""The AttnRes decode-form kernels (phase 1 with D split across programs) at K3 shapes (d = 7168, bf16) compile for
h200 and mi355x without register spills, the scores on the matrix units."""
from __future__ import annotations

import pytest

from k3c.codegen.aot import compile_kernels
from k3c.codegen.kernels.attnres import emit_attnres_phase1_split
from k3c.codegen.targets import get_target


@pytest.mark.parametrize("target", ["h200", "mi355x"])
def test_split_kernels_compile_without_spills(aot_dir, target):
    t = get_target(target)
    # k3-wide decode groups (N = 1, Q = 7 and N = 2, Q = 9) and kimi-k3's largest group (8 blocks, 24 queries)
    kernels = [k for n, q in ((1, 7), (2, 9), (8, 24))
               for k in emit_attnres_phase1_split(7168, n, q, 1e-5, target=t, dtype="bf16")]
    compiled = compile_kernels(kernels, t, str(aot_dir / target), progress=False)
    assert len(compiled) == len(kernels)
    for ck in compiled:
        assert not ck.resources.has_spills, f"{ck.name}: {ck.resources}"
        if "split_scores" in ck.name:
            assert ck.resources.matrix_ops, f"{ck.name} should use the matrix units"
