"""The mxfp4 pass and the `quantization:` spec section: what gets packed, the IR it leaves (verified, round-tripping
through the printer and parser), and spec errors with file, line and field."""
import pytest

from k3c.errors import IRError, SpecError
from k3c.frontend import dump_spec_yaml, parse_spec_text
from k3c.frontend.to_ir import spec_to_module
from k3c.ir import parse_module, print_module, verify
from k3c.passes import run_pass

from .conftest import ROOT

TINY = (ROOT / "examples" / "k3-tiny.yaml").read_text()
TINY_LINES = TINY.count("\n")          # an appended section starts on line TINY_LINES + 1
NO_PRECISION = TINY.split("precision:")[0]   # k3-tiny without its precision section (it is the last one)


def quantized(section: str, base: str = TINY):
    return parse_spec_text(base + section, "q.yaml")


def lowered(spec):
    module, ctx = run_pass(spec_to_module(spec), "mxfp4")
    return module, ctx


def error_of(section: str, base: str = TINY) -> SpecError:
    with pytest.raises(SpecError) as info:
        quantized(section, base)
    return info.value


def test_no_section_no_change(tiny):
    module, ctx = run_pass(tiny, "mxfp4")
    assert module == tiny and not ctx.counts


def test_experts_packed_and_ir_round_trips():
    spec = quantized("quantization:\n  format: mxfp4\n  rule: rceil\n", NO_PRECISION)
    module, ctx = lowered(spec)
    n_moe = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    assert dict(ctx.counts) == {"params": 3 * n_moe, "moe_layers": n_moe}
    verify(module)
    assert parse_module(print_module(module)) == module
    params = module.params()
    e, m, z = spec.mlp.moe.num_experts, spec.mlp.moe.expert_intermediate_size, spec.mlp.moe.latent_dim
    for w, (rows, k) in (("w1", (m, z)), ("w3", (m, z)), ("w2", (z, m))):
        src = f"layers.1.block_sparse_moe.experts.{w}"
        assert src not in params
        packed, scale = params[src + ".weight_packed"], params[src + ".weight_scale"]
        assert str(packed.type) == f"u8[{e}, {rows}, {k // 2}]" and str(scale.type) == f"u8[{e}, {rows}, {k // 32}]"
        for p in (packed, scale):
            assert (p.attr("quant"), p.attr("rule"), p.attr("source")) == ("mxfp4", "rceil", src)
    moes = module.ops_named("moe")
    assert len(moes) == n_moe and all(op.attr("expert_format") == "mxfp4" for op in moes)
    # everything else keeps its bf16 params
    assert all(op.type.dtype == "bf16" for n, op in params.items() if ".experts." not in n and op.type.rank == 2)
    # idempotent: a second run finds nothing left to pack
    again, ctx2 = run_pass(module, "mxfp4")
    assert again == module and not ctx2.counts


def test_exclude_keeps_a_layer_bf16():
    spec = quantized("quantization:\n  format: mxfp4\n  exclude: ['layers.2.*']\n", NO_PRECISION)
    module, ctx = lowered(spec)
    n_moe = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    assert ctx.counts["moe_layers"] == n_moe - 1
    by_layer = {op.attr("layer"): op.attr("expert_format", "bf16") for op in module.ops_named("moe")}
    assert by_layer[2] == "bf16" and by_layer[1] == by_layer[3] == "mxfp4"
    assert "layers.2.block_sparse_moe.experts.w1" in module.params()
    verify(module)


def test_section_round_trips_and_sets_precision_plan():
    spec = quantized("quantization:\n  format: mxfp4\n", NO_PRECISION)
    assert spec.quantization.rule == "floor"
    assert spec.precision.weights.format == "mxfp4"                  # derived from the section
    assert parse_spec_text(dump_spec_yaml(spec)) == spec
    attrs = spec_to_module(spec).attr_dict
    assert attrs["quant_format"] == "mxfp4" and attrs["quant_include"] == spec.quantization.include
    assert "quant_format" not in spec_to_module(parse_spec_text(TINY)).attr_dict


@pytest.mark.parametrize("section, line, field, words", [
    ("quantization:\n  format: mxfp4\n  rul: rceil\n", 3, "quantization.rul", "did you mean 'rule'"),
    ("quantization:\n  format: nvfp4\n", 2, "quantization.format", "must be one of mxfp4"),
    ("quantization:\n  rule: floor\n", 1, "quantization.format", "missing required field"),
    ("quantization:\n  format: mxfp4\n  rule: ceil\n", 3, "quantization.rule", "did you mean 'rceil'"),
    ("quantization:\n  format: mxfp4\n  include:\n    - '*.experts.w1'\n    - '*.expert.w9'\n", 5,
     "quantization.include", "matches no weight"),
    ("quantization:\n  format: mxfp4\n  include: ['*.experts.*', '*.q_proj.weight']\n", 3,
     "quantization.include", "attention weights are consumed inside the fused KDA / MLA kernels"),
    ("quantization:\n  format: mxfp4\n  exclude: ['*.experts.w2']\n", 3, "quantization.exclude",
     "quantized together"),
    ("quantization:\n  format: mxfp4\n  exclude: ['*.experts.*']\n", 3, "quantization.exclude",
     "selects no weight"),
    ("quantization:\n  format: mxfp4\n  rule: rceil\n", 3, "quantization.rule", "disagrees with precision"),
    ("quantization: [mxfp4]\n", 1, "quantization", "must be a mapping"),
])
def test_bad_sections_name_file_line_field(section, line, field, words):
    err = error_of(section)
    assert err.file == "q.yaml" and err.line == TINY_LINES + line and err.field == field, str(err)
    assert words in err.message


def test_precision_plan_must_agree():
    base = TINY.replace("    format: mxfp4\n    scale_rule: floor\n",
                        "    format: mxfp4\n    exclude: ['layers.1.*']\n    scale_rule: floor\n")
    err = error_of("quantization:\n  format: mxfp4\n", base)
    assert "disagrees with precision.weights" in err.message and "layers.1.block_sparse_moe" in err.message


def test_reduction_dim_not_multiple_of_32_names_the_weight():
    base = TINY.replace("expert_intermediate_size: 32", "expert_intermediate_size: 48")
    err = error_of("quantization:\n  format: mxfp4\n", base)
    assert "experts.w2" in err.message and "48" in err.message and err.line == TINY_LINES + 2


def test_pass_rejects_hand_made_selection_of_non_experts(tiny):
    attrs = dict(tiny.attrs, quant_format="mxfp4", quant_rule="floor", quant_include=("*.q_proj.weight",),
                 quant_exclude=())
    with pytest.raises(IRError, match="routed experts only"):
        run_pass(tiny.replace(attrs=attrs), "mxfp4")
