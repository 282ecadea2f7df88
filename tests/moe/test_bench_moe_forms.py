"""The grouped-GEMM forms bench/moe.py times but k3c does not ship (bench/moe_forms.py): split and postscale through
the Triton interpreter against the reference routed experts; the perm pair decode's PTX op list run in Python with
PTX semantics (test_moe_pairs_decode.run_ops) on words permuted by the load-time transform, bit for bit against
k3c.quant's dequantization; its bit map; the perm kernels compiled for sm_90 without spills."""
from __future__ import annotations

import pytest
import torch

from k3c import reference as ref
from k3c.codegen.kernels import moe as KM
from k3c.codegen.targets import get_target
from k3c.codegen.writer import CodegenError
from k3c.quant import mxfp4_dequantize, mxfp4_quantize
from k3c.runtime.kernel_impls import moe as M

from .test_moe_kernels import SITU, experts, rel
from .test_moe_pairs_decode import run_ops


@pytest.fixture
def forms(bench_script):
    return bench_script("moe_forms")


@pytest.mark.parametrize("form", ["split", "postscale"])
def test_split_forms_equal_reference_on_dequantized_weights(forms, form):
    g = torch.Generator().manual_seed(2)
    t, e, k, z, m = 5, 3, 2, 64, 64
    wt, ids, off, perm = M.route(torch.randn(t, e, generator=g), None, top_k=k)
    x = torch.randn(t, z, generator=g).to(torch.bfloat16)
    qs = [mxfp4_quantize(w) for w in experts(e, m, z, torch.float32, g)]
    d1, d3, d2 = (mxfp4_dequantize(p, s, torch.bfloat16) for p, s in qs)
    # two N tiles and two K steps per program: the nibble / scale indexing across tiles
    cpu = get_target("cpu")
    pg = forms.form_plan("gate_up", m, z, 1, "upcast", "bf16", cpu, form, block_n=32, block_k=32)
    pd = forms.form_plan("down", z, m, 1, "upcast", "bf16", cpu, form, block_n=32, block_k=32)
    assert pg.tag.startswith(form) and not (pg.plan.joined or pg.plan.gemv or pg.plan.pairs)
    h = forms.grouped_gemm("gate_up", x, [*qs[0], *qs[1]], off, perm, top_k=k, act=SITU, plan=pg)
    y = forms.grouped_gemm("down", h, [*qs[2]], off, perm, top_k=k, plan=pd)
    got = M.combine(y, wt, ids, top_k=k, num_experts=e)
    assert rel(got, ref.routed_experts(x, d1, d3, d2, wt, ids.long(), SITU)) <= 1e-2


@pytest.mark.parametrize("ops, scales", [("E2M1_PAIRS_PERM_OPS", range(0, 128)),
                                         ("E2M1_PAIRS_PERM_OPS", range(128, 255)),
                                         ("E2M1_PAIRS1_PERM_OPS", range(0, KM.PAIRS1_MAX_SCALE + 1))])
def test_perm_pairs_decode_equals_dequantize_bitwise(forms, ops, scales):
    """The perm decode on words permuted by the load-time transform (pairs_perm_words): every byte value at every
    position of a canonical word, random words, every scale it is used for."""
    g = torch.Generator().manual_seed(1)
    s = torch.tensor(list(scales), dtype=torch.int64)
    base = torch.arange(256, dtype=torch.int64)
    byts = torch.cat([torch.stack([(base + 37 * j) % 256 for j in range(4)], dim=1),
                      torch.randint(0, 256, (256, 4), generator=g)])
    stored = forms.pairs_perm_words(byts.to(torch.uint8)).to(torch.int64)
    words = (stored << torch.tensor([0, 8, 16, 24])).sum(1)
    W, S = torch.meshgrid(words, s, indexing="ij")
    out = run_ops(getattr(forms, ops), {"$4": W.reshape(-1), "$5": S.reshape(-1)})
    got = torch.stack([out[f"${j}"] for j in range(4)], dim=1)
    got = torch.stack([got & 0xFFFF, got >> 16], dim=2).reshape(-1, 8)
    packed = byts[:, None, :].expand(-1, len(s), -1).reshape(-1, 4).to(torch.uint8)
    want = mxfp4_dequantize(packed.repeat(1, 4), S.reshape(-1, 1).to(torch.uint8), torch.bfloat16)[:, :8]
    want = want.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(got, want)


def test_perm_layout_is_a_bit_permutation_of_each_word(forms):
    mp = forms.pairs_perm_bit_map()
    assert sorted(mp) == list(range(32))
    x = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    y = forms.pairs_perm_words(x)
    assert y.shape == x.shape and y.dtype == torch.uint8
    wx = (x.reshape(3, 5, 16, 4).to(torch.int64) << torch.tensor([0, 8, 16, 24])).sum(-1)
    wy = (y.reshape(3, 5, 16, 4).to(torch.int64) << torch.tensor([0, 8, 16, 24])).sum(-1)
    for stored, canon in enumerate(mp):
        assert torch.equal((wy >> stored) & 1, (wx >> canon) & 1)
    one = torch.zeros(1, 4, dtype=torch.uint8)
    one[0, 0] = 1
    assert int(torch.count_nonzero(forms.pairs_perm_words(one))) == 1     # one bit in, one bit out
    text = forms.E2M1_PAIRS1_PERM_ASM
    assert text.count(";") == len(forms.E2M1_PAIRS1_PERM_OPS) + 1 and text.count("prmt.b32") == 4
    assert text.count("shf.r.wrap.b32") == 2 and text.count("mul.rn.bf16x2") == 4


def test_perm_plan_needs_the_ptx_decode(forms):
    """A perm plan's weights are in the load-time layout, which only the PTX decode reads: elsewhere it is refused."""
    t = get_target("h200")
    plan = forms.form_plan("down", 64, 64, 1, "upcast", "bf16", t, "perm")
    assert plan.plan.pairs and plan.tag.startswith("pairs1p")
    src = forms.emit_form_gemm("down", 64, 64, target=t, plan=plan, interpret=False).source
    assert "shf.r.wrap.b32" in src
    with pytest.raises(CodegenError, match="perm"):
        forms.emit_form_gemm("down", 64, 64, target=t, plan=plan, interpret=True)
    with pytest.raises(CodegenError, match="perm"):
        forms.form_plan("down", 64, 64, 1, "upcast", "bf16", get_target("mi300x"), "perm")      # no pair decode


def test_sm90_perm_plans_at_k3_shapes(forms, aot_dir):
    """The perm decode at K3 expert shapes compiles for sm_90 without spills, on bf16x2 multiplies and mma.sync."""
    from k3c.codegen.aot import compile_kernels

    t = get_target("h200")
    ks = []
    for kind, n, k in (("gate_up", 3072, 3584), ("down", 3584, 3072)):
        plan = forms.form_plan(kind, n, k, 1, "upcast", "bf16", t, "perm")
        ks.append(forms.emit_form_gemm(kind, n, k, target=t, plan=plan, num_experts=896, top_k=16,
                                       act="swiglu" if kind == "gate_up" else None, interpret=False))
    cks = compile_kernels(ks, t, str(aot_dir / "h200_perm"), progress=False)
    for ck in cks:
        ptx = (aot_dir / "h200_perm" / ck.files["ptx"]).read_text()
        assert not ck.resources.has_spills, (ck.name, ck.resources)
        assert "jp1p" in ck.name and "shf.r.wrap.b32" in ptx and "mul.rn.bf16x2" in ptx and "mma.sync" in ptx
