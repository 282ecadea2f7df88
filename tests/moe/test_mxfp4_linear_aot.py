"""The dense MXFP4 x bf16 GEMM of quantized linears (lm_head, MLPs, latent projections) compiled ahead of time at K3
shapes: upcast in registers on sm_90 (prmt decode, bf16 mma.sync / wgmma, the dequant kernel + bf16 GEMM at
prefill buckets), native v_mfma_scale on gfx950 with MXFP8 activations, bf16 activations upcast there; no spills.
And the emitters hand the AOT artifact exactly these kernels for a quantized model."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import k3c
from k3c.codegen.aot import compile_kernels
from k3c.codegen.catalogue import emit_kernels
from k3c.codegen.catalogue.mxfp4 import dense_kernels, dense_mx
from k3c.codegen.targets import get_target
from k3c.frontend import parse_spec_text

ROOT = Path(__file__).resolve().parents[2]

HEAD = (163840, 7168)          # K3 lm_head [vocab, hidden]
LATENT_UP = (7168, 3584)       # K3 routed_expert_up_proj [hidden, latent]


def compiled(aot_dir, target, shape, act, tag):
    t = get_target(target)
    ks = dense_kernels(*shape, "bf16", t, act, "lm_head")
    out = aot_dir / tag
    cks = compile_kernels(ks, t, str(out), progress=False)
    assert not [(ck.name, ck.resources) for ck in cks if ck.resources.has_spills]
    asm = {ck.name: (out / ck.files["amdgcn" if t.backend == "hip" else "ptx"]).read_text() for ck in cks}
    return cks, asm


def test_dequant_plan_only_where_it_fits():
    from k3c.codegen.catalogue.mxfp4 import dense_plan, dequant_fits

    t = get_target("h200")
    assert not dequant_fits(*HEAD) and dequant_fits(*LATENT_UP) and dequant_fits(33792, 7168)    # K3 dense MLP
    assert not dense_plan(*HEAD, 4096, "upcast", "bf16", t).dequant
    assert dense_plan(*LATENT_UP, 4096, "upcast", "bf16", t).dequant


def test_modes_follow_the_target():
    assert dense_mx(get_target("h200"), "mxfp8") == "upcast"
    assert dense_mx(get_target("mi300x"), "mxfp8") == "upcast"
    assert dense_mx(get_target("mi355x"), "mxfp8") == "e4m3"
    assert dense_mx(get_target("mi355x"), "bf16") == "upcast"
    assert dense_mx(get_target("b200"), "mxfp4") == "e2m1"


@pytest.mark.parametrize("shape", [HEAD, LATENT_UP], ids=["lm_head", "latent_up"])
def test_sm90_upcast_spill_free(aot_dir, shape):
    cks, asm = compiled(aot_dir, "h200", shape, "mxfp8", f"h200_{shape[0]}")
    names = set(asm)
    assert any(n.endswith("_jp1") for n in names) and any(n.endswith("_jp") for n in names)   # pair decode, 1 / 2 mul
    # prefill buckets: dequant + bf16 GEMM where the workspace and the dequant grid fit, the MMA form for the head
    assert any(n.startswith("k3c_moe_dequant") for n in names) == (shape != HEAD)
    assert (f"k3c_moe_dense_n{shape[0]}_k{shape[1]}_bf16_m128" in names) == (shape != HEAD)    # bf16 GEMM
    for name, ptx in asm.items():
        assert not re.search(r"tcgen05|mfma_scale", ptx)
        if "mxupcast" in name:
            assert "prmt.b32" in ptx and ("mma.sync" in ptx or "wgmma" in ptx), name


def test_gfx950_native_and_upcast_spill_free(aot_dir):
    _, asm = compiled(aot_dir, "mi355x", HEAD, "mxfp8", "mi355x_e4m3")
    assert all(re.search(r"v_mfma_scale_f32_\w+_f8f6f4", a) for a in asm.values())
    _, asm = compiled(aot_dir, "mi355x", LATENT_UP, "bf16", "mi355x_upcast")        # bf16 activations stay bf16
    assert not any("mfma_scale" in a for a in asm.values())


def test_emitters_give_the_dense_kernels_of_a_quantized_model():
    text = (ROOT / "examples" / "k3-tiny.yaml").read_text().split("precision:")[0]
    spec = parse_spec_text(text + "quantization:\n  format: mxfp4\n  include: ['*.experts.w*', 'lm_head.weight', "
                                  "'*.routed_expert_*_proj.weight', '*.shared_experts.*']\n", "q.yaml")
    t = get_target("h200")
    names = {ks.name for ks in emit_kernels(k3c.compile(spec, target=t).module, t)}
    d, v, z, s = spec.hidden_size, spec.vocab_size, spec.mlp.moe.latent_dim, spec.mlp.moe.shared_width
    for n, k in ((v, d), (z, d), (d, z), (s, d), (d, s)):
        assert any(x.startswith(f"k3c_moe_dense_n{n}_k{k}_bf16_m16_mxupcast") for x in names), (n, k)
    assert not any(x.startswith("k3c_gemm") and f"n{v}_" in x for x in names)     # no bf16 head GEMM
    plain = parse_spec_text(text, "p.yaml")
    assert not any("mxupcast" in x for x in {ks.name for ks in emit_kernels(k3c.compile(plain, target=t).module, t)})
