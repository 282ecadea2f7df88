"""The lanes form of the upcast grouped GEMM (k3c.codegen.kernels.moe_lanes) and its load-time payload layout
(k3c.runtime.kernel_impls.moe_layout): the layout against its definition and its inverse, the kernels through the
interpreter against the reference routed experts (and against canonical payloads, which must come out wrong), the
plan rules, and the sm_90 compile (wgmma with the weights in registers, the perm decode's PTX, no spills)."""
from __future__ import annotations

import pytest
import torch

from k3c import reference as ref
from k3c.codegen.aot import compile_kernels
from k3c.codegen.kernels.moe import emit_moe_gemm, moe_gemm_plan
from k3c.codegen.kernels.moe_lanes import pairs_perm_bit_map
from k3c.codegen.targets import get_target
from k3c.codegen.writer import CodegenError
from k3c.frontend.spec import ActivationSpec
from k3c.quant import mxfp4_dequantize, mxfp4_quantize
from k3c.runtime.kernel_impls import moe as M
from k3c.runtime.kernel_impls.moe_layout import from_lanes, to_lanes

SITU = ActivationSpec("situ", 4.0, 25.0)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def by_definition(packed: torch.Tensor) -> torch.Tensor:
    """The lanes layout written out from its definition, one byte and one bit at a time (slow; small inputs)."""
    rows = packed.reshape(-1, packed.shape[-1]).tolist()
    s2c = pairs_perm_bit_map()
    out = []
    for row in rows:
        moved = [row[g * 64 + 4 * (j % 16) + j // 16] for g in range(len(row) // 64) for j in range(64)]
        words = []
        for q in range(0, len(moved), 4):
            canon = sum(b << (8 * t) for t, b in enumerate(moved[q:q + 4]))
            stored = sum(((canon >> s2c[b]) & 1) << b for b in range(32))
            words += [(stored >> (8 * t)) & 0xFF for t in range(4)]
        out.append(words)
    return torch.tensor(out, dtype=torch.uint8).reshape(packed.shape)


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 192)])
def test_lanes_layout_is_its_definition_and_inverts(shape):
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    lanes = to_lanes(p)
    assert torch.equal(lanes, by_definition(p)) and not torch.equal(lanes, p)
    assert torch.equal(from_lanes(lanes), p)
    q = p.clone()
    assert to_lanes(q, in_place=True) is q and torch.equal(q, lanes)
    assert from_lanes(q, in_place=True) is q and torch.equal(q, p)


def test_lanes_layout_rejects_bad_payloads():
    with pytest.raises(ValueError, match="multiple of 128"):
        to_lanes(torch.zeros(4, 32, dtype=torch.uint8))
    with pytest.raises(ValueError):
        to_lanes(torch.zeros(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        to_lanes(torch.zeros(64, 4, dtype=torch.uint8).T, in_place=True)


def _experts(case):
    g = torch.Generator().manual_seed(5)
    t, e, k, z, m = {"odd": (7, 6, 3, 128, 256), "empty_experts": (3, 16, 2, 128, 128),
                     "rows64": (48, 2, 2, 128, 128)}[case]
    wt, ids, off, perm = M.route(torch.randn(t, e, generator=g), None, top_k=k)
    x = torch.randn(t, z, generator=g).to(torch.bfloat16)
    qs = [mxfp4_quantize(torch.randn(*s, generator=g) / s[-1] ** 0.5) for s in ((e, m, z), (e, m, z), (e, z, m))]
    return t, e, k, z, m, wt, ids, off, perm, x, qs


def _run(x, qs, wt, ids, off, perm, e, k, z, m, rows, plans=None):
    cpu = get_target("cpu")
    pg, pd = plans or (moe_gemm_plan("gate_up", m, z, rows, "upcast", "bf16", cpu, lanes=True),
                       moe_gemm_plan("down", z, m, rows, "upcast", "bf16", cpu, lanes=True))
    h = M.grouped_gemm("gate_up", x, [*qs[0], *qs[1]], off, perm, top_k=k, mx="upcast", act=SITU, plan=pg)
    y = M.grouped_gemm("down", h, [*qs[2]], off, perm, top_k=k, mx="upcast", plan=pd)
    return M.combine(y, wt, ids, top_k=k, num_experts=e)


@pytest.mark.parametrize("case", ["odd", "empty_experts", "rows64"])
def test_lanes_form_equals_reference(case):
    t, e, k, z, m, wt, ids, off, perm, x, qs = _experts(case)
    rows = -(-t * k // e)
    want = ref.routed_experts(x, *(mxfp4_dequantize(p, s, torch.bfloat16) for p, s in qs), wt, ids.long(), SITU)
    lanes = [(to_lanes(p), s) for p, s in qs]
    got = _run(x, lanes, wt, ids, off, perm, e, k, z, m, rows)
    assert rel(got, want) <= 1e-2
    # the kernels read the lanes layout: canonical payloads give something else entirely
    assert rel(_run(x, qs, wt, ids, off, perm, e, k, z, m, rows), want) > 0.5
    if case == "rows64":
        assert moe_gemm_plan("down", z, m, rows, "upcast", "bf16", get_target("cpu"), lanes=True).block_m == 64


def test_lanes_plans():
    h200 = get_target("h200")
    p = moe_gemm_plan("gate_up", 3072, 3584, 1, "upcast", "bf16", h200, lanes=True)
    assert p.lanes and p.tag.startswith("lanes1") and (p.block_m, p.block_n, p.block_k, p.num_warps,
                                                         p.num_stages) == (16, 64, 256, 4, 2)
    q = moe_gemm_plan("down", 3584, 3072, 128, "upcast", "bf16", h200, lanes=True)
    assert (q.block_m, q.block_n, q.block_k, q.num_warps) == (128, 128, 128, 8)
    assert not moe_gemm_plan("gate_up", 3072, 3584, 1, "upcast", "bf16", h200).lanes     # not a default
    with pytest.raises(CodegenError, match="multiple of 128"):
        moe_gemm_plan("down", 64, 96, 1, "upcast", "bf16", h200, lanes=True)
    with pytest.raises(CodegenError, match="bf16"):
        moe_gemm_plan("down", 128, 128, 1, "upcast", "fp16", h200, lanes=True)
    with pytest.raises(CodegenError, match="hip"):
        emit_moe_gemm("down", 128, 128, target=get_target("mi300x"), mx="upcast", num_experts=4, interpret=False,
                      plan=moe_gemm_plan("down", 128, 128, 1, "upcast", "bf16", get_target("mi300x"), lanes=True))


def test_lanes_form_compiles_for_sm90_with_register_operands(tmp_path):
    """K3 shapes, decode tiles: wgmma with the decoded weights as the register A operand (no shared-memory copy of
    the weight tile), the perm decode's rotates and bf16x2 multiplies, no spills."""
    h200 = get_target("h200")
    ks = [emit_moe_gemm(kind, n, k, target=h200, num_experts=896, top_k=16, mx="upcast", interpret=False,
                        act=SITU if kind == "gate_up" else None,
                        plan=moe_gemm_plan(kind, n, k, 1, "upcast", "bf16", h200, lanes=True))
          for kind, n, k in (("gate_up", 3072, 3584), ("down", 3584, 3072))]
    cks = compile_kernels(ks, h200, str(tmp_path), progress=False, cache=False)
    for ck in cks:
        assert not ck.resources.has_spills, ck.resources
        ptx = (tmp_path / ck.files["ptx"]).read_text()
        assert "wgmma.mma_async" in ptx and "mul.rn.bf16x2" in ptx and "shf.r.wrap" in ptx
        ttgir = (tmp_path / ck.files["ttgir"]).read_text()
        dots = [ln for ln in ttgir.splitlines() if "ttng.warp_group_dot " in ln]
        assert dots and all(": tensor<" in ln.split("ttng.warp_group_dot")[1].split("*")[0] for ln in dots), dots
