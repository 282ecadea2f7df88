"""MXFP4 dense linears (issue 7): the `quantization:` section selecting lm_head, the dense MLP and the MoE layer's
shared experts / latent projections; what the mxfp4 and moe-lower passes leave (verified, printer/parser round trip,
codegen marks); spec errors for the weights that stay float, with file, line and field."""
import pytest

from k3c.errors import IRError, SpecError
from k3c.frontend import dump_spec_yaml, parse_spec_text
from k3c.frontend.to_ir import spec_to_module
from k3c.ir import parse_module, print_module, verify
from k3c.ir.mxfp4_weights import packed_name
from k3c.passes import run_pass

from .conftest import ROOT

TINY = (ROOT / "examples" / "k3-tiny.yaml").read_text()
NO_PRECISION = TINY.split("precision:")[0]
BASE_LINES = NO_PRECISION.count("\n")
ALL = ("quantization:\n  format: mxfp4\n  include: ['*.experts.w*', 'lm_head.weight', "
       "'*.routed_expert_*_proj.weight', '*.shared_experts.*', 'layers.0.mlp.*']\n")


def spec_of(section: str, base: str = NO_PRECISION):
    return parse_spec_text(base + section, "q.yaml")


def error_of(section: str, base: str = NO_PRECISION) -> SpecError:
    with pytest.raises(SpecError) as info:
        spec_of(section, base)
    return info.value


def test_packed_names():
    assert packed_name("lm_head.weight", "weight_packed") == "lm_head.weight_packed"
    assert packed_name("weight", "weight_scale") == "weight_scale"
    assert packed_name("layers.1.block_sparse_moe.experts.w1", "weight_scale") == \
        "layers.1.block_sparse_moe.experts.w1.weight_scale"


def test_all_quantizable_linears_packed_and_round_trip():
    spec = spec_of(ALL)
    assert parse_spec_text(dump_spec_yaml(spec)) == spec
    module, ctx = run_pass(spec_to_module(spec), "mxfp4")
    n_moe = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    # experts 3 + shared 3 + latent 2 per MoE layer; dense MLP 3; lm_head 1
    assert dict(ctx.counts) == {"params": 8 * n_moe + 3 + 1, "moe_layers": n_moe, "linear_ops": n_moe + 2}
    verify(module)
    assert parse_module(print_module(module)) == module
    params = module.params()
    d, v = spec.hidden_size, spec.vocab_size
    assert "lm_head.weight" not in params
    for part, cols in (("weight_packed", d // 2), ("weight_scale", d // 32)):
        p = params[f"lm_head.{part}"]
        assert str(p.type) == f"u8[{v}, {cols}]"
        assert (p.attr("quant"), p.attr("rule"), p.attr("source")) == ("mxfp4", "floor", "lm_head.weight")
    head = module.ops_named("lm_head")[0]
    assert head.attr("weight_format") == "mxfp4" and head.attr("act_format") == "bf16"
    mlp = module.ops_named("mlp")[0]
    assert mlp.attr("weight_format") == "mxfp4" and "layers.0.mlp.down_proj.weight_scale" in params
    for op in module.ops_named("moe"):
        assert op.attr("expert_format") == "mxfp4"
        assert set(op.attr("mxfp4_linears")) == {"shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                                                 "shared_experts.down_proj.weight",
                                                 "routed_expert_down_proj.weight", "routed_expert_up_proj.weight"}
    # the router, attention, norms and embedding keep their float params
    assert "layers.1.block_sparse_moe.gate.weight" in params and "embed_tokens.weight" in params
    assert all(op.type.dtype != "u8" for n, op in params.items() if ".self_attn." in n)
    again, ctx2 = run_pass(module, "mxfp4")
    assert again == module and not ctx2.counts

    low, lctx = run_pass(module, "moe-lower")
    verify(low)
    assert parse_module(print_module(low)) == low
    assert lctx.counts["mxfp4_linears"] == 5 * n_moe
    lin = {op.attr("proj"): op for op in low.ops_named("moe_linear") if op.attr("layer") == 1}
    assert lin["router"].attr("weight_format", "bf16") == "bf16" and lin["router"].attr("out_f32")
    assert lin["latent_down"].attr("weight_format") == lin["latent_up"].attr("weight_format") == "mxfp4"
    assert lin["latent_up"].attr("residual")
    shared = [op for op in low.ops_named("mlp") if op.attr("layer") == 1]
    assert len(shared) == 1 and shared[0].attr("weight_format") == "mxfp4"
    names = [low.defs[v].attr("name") for v in lin["latent_down"].inputs[1:]]
    assert names == ["layers.1.block_sparse_moe.routed_expert_down_proj.weight_packed",
                     "layers.1.block_sparse_moe.routed_expert_down_proj.weight_scale"]

    gen, gctx = run_pass(low, "codegen")
    head = gen.ops_named("lm_head")[0]
    assert head.attr("impl") == "kernel"          # the dense MXFP4 GEMM (a float lm_head stays extern)
    assert run_pass(run_pass(spec_to_module(spec_of("")), "moe-lower")[0], "codegen")[0] \
        .ops_named("lm_head")[0].attr("impl") == "extern"


def test_subset_keeps_the_rest_float():
    spec = spec_of("quantization:\n  format: mxfp4\n  include: ['lm_head.weight', "
                   "'layers.1.block_sparse_moe.routed_expert_up_proj.weight']\n")
    module, ctx = run_pass(spec_to_module(spec), "mxfp4")
    assert dict(ctx.counts) == {"params": 2, "linear_ops": 2}
    moe1 = [op for op in module.ops_named("moe") if op.attr("layer") == 1][0]
    assert moe1.attr("mxfp4_linears") == ("routed_expert_up_proj.weight",)
    assert moe1.attr("expert_format", "bf16") == "bf16"
    assert all(op.attr("mxfp4_linears", None) is None for op in module.ops_named("moe") if op.attr("layer") != 1)
    low, _ = run_pass(module, "moe-lower")
    verify(low)
    lin = {(op.attr("layer"), op.attr("proj")): op.attr("weight_format", "bf16") for op in low.ops_named("moe_linear")}
    assert lin[(1, "latent_up")] == "mxfp4" and lin[(1, "latent_down")] == "bf16" and lin[(2, "latent_up")] == "bf16"


@pytest.mark.parametrize("section, line, field, words", [
    ("quantization:\n  format: mxfp4\n  include:\n    - 'lm_head.weight'\n    - '*.router*'\n", 5,
     "quantization.include", "matches no weight"),
    ("quantization:\n  format: mxfp4\n  include:\n    - 'lm_head.weight'\n    - '*.gate.weight'\n", 5,
     "quantization.include", "the router GEMM stays float"),
    ("quantization:\n  format: mxfp4\n  include: ['*.kv_b_proj.weight']\n", 3,
     "quantization.include", "fused KDA / MLA kernels"),
    ("quantization:\n  format: mxfp4\n  include: ['layers.0.self_attn.q_proj.weight']\n", 3,
     "quantization.include", "fused KDA / MLA kernels"),
    ("quantization:\n  format: mxfp4\n  include: ['embed_tokens.weight']\n", 3,
     "quantization.include", "embedding table is gathered"),
    ("quantization:\n  format: mxfp4\n  include: ['*.routed_expert_norm.weight']\n", 3,
     "quantization.include", "cannot quantize"),
    ("quantization:\n  format: mxfp4\n  include: ['*.shared_experts.*']\n  exclude: ['*.shared_experts.up_proj.*']\n",
     4, "quantization.exclude", "quantized together"),
    ("quantization:\n  format: mxfp4\n  include: ['layers.0.mlp.gate_proj.weight']\n", 3,
     "quantization.include", "gate_proj, up_proj and down_proj are quantized together"),
])
def test_bad_sections_name_file_line_field(section, line, field, words):
    err = error_of(section)
    assert err.file == "q.yaml" and err.line == BASE_LINES + line and err.field == field, str(err)
    assert words in err.message, err.message
    if "cannot quantize" in err.message:        # says what can be
        assert "lm_head.weight (untied)" in err.message and "routed_expert_down_proj" in err.message


def test_tied_lm_head_has_nothing_to_quantize():
    base = NO_PRECISION.replace("  max_context: 4096\n", "  max_context: 4096\n  tie_word_embeddings: true\n")
    err = error_of("quantization:\n  format: mxfp4\n  include: ['lm_head.weight']\n", base)
    assert "matches no weight" in err.message and err.field == "quantization.include"


def test_reduction_dim_not_multiple_of_32():
    base = NO_PRECISION.replace("dense_intermediate_size: 128", "dense_intermediate_size: 120")
    err = error_of("quantization:\n  format: mxfp4\n  include: ['layers.0.mlp.*']\n", base)
    assert "layers.0.mlp.down_proj.weight" in err.message and "120" in err.message


def test_verifier_checks_packed_shapes():
    spec = spec_of(ALL)
    module, _ = run_pass(spec_to_module(spec), "mxfp4")
    text = print_module(module).replace("u8[256, 2]", "u8[256, 3]")      # lm_head.weight_scale
    with pytest.raises(IRError, match="lm_head.weight_scale"):
        verify(parse_module(text))


def test_pass_rejects_partial_mlp_and_attention(tiny):
    attrs = dict(tiny.attrs, quant_format="mxfp4", quant_rule="floor", quant_include=("layers.0.mlp.gate_proj.*",),
                 quant_exclude=())
    with pytest.raises(IRError, match="quantized together"):
        run_pass(tiny.replace(attrs=attrs), "mxfp4")
    attrs["quant_include"] = ("*.gate.weight",)
    with pytest.raises(IRError, match="no op reads it as a plain GEMM operand"):
        run_pass(tiny.replace(attrs=attrs), "mxfp4")
