"""Spec -> IR lowering: dataflow equals K3.md section 4's pseudo-code, weights equal the canonical table."""
import dataclasses

import pytest

from k3c.frontend.spec import AttnResSpec, MLPSpec
from k3c.frontend.to_ir import spec_to_module
from k3c.ir import TensorType, verify
from k3c.frontend.weight_names import weight_table

from .helpers import EXAMPLES, example_module, example_spec


class Terms:
    """Hash-consed symbolic terms: equal dataflow <=> equal ids (no exponential blow-up on shared subterms)."""

    def __init__(self):
        self.ids = {}

    def __call__(self, *node):
        return self.ids.setdefault(node, len(self.ids))


def evaluate(module, t: Terms):
    """The module's output as a symbolic term: what each op computes from what, weights by name."""
    env = {}
    for op in module.ops:
        a = op.attr_dict
        if op.op in ("input", "param"):
            val = t(op.op, a["name"])
        elif op.op == "add":
            val = t("add", env[op.inputs[0]], env[op.inputs[1]])
        elif op.op == "attn_res_mix":
            *sources, proj, norm = (env[v] for v in op.inputs)
            val = t("mix", proj, norm, *sources)
        elif op.op in ("kda", "mla"):
            val = t("attn", a["layer"], env[op.inputs[0]])
        elif op.op in ("mlp", "moe"):
            val = t("ffn", a["layer"], env[op.inputs[0]])
        else:                              # embedding, rmsnorm, lm_head: op(x, weight)
            val = t(op.op, env[op.inputs[0]], env[op.inputs[1]])
        env[op.results[0]] = val
    return env[module.outputs[0]]


def k3_pseudo_code(spec, t: Terms):
    """K3.md section 4, transcribed."""
    P = lambda name: t("param", name)                                         # noqa: E731
    norm = lambda x, w: t("rmsnorm", x, P(w))                                 # noqa: E731

    def mix(blocks, partial, prefix):
        return t("mix", P(prefix + "proj_weight"), P(prefix + "norm_weight"), *blocks, partial)

    S = spec.attn_res.block_size
    partial = t("embedding", t("input", "input_ids"), P("embed_tokens.weight"))
    blocks = []
    for l in range(spec.num_layers):
        p = f"layers.{l}."
        h = mix(blocks, partial, p + "self_attention_res.") if blocks else partial
        if l % S == 0:
            blocks.append(partial)
            partial = None
        y = t("attn", l, norm(h, p + "input_layernorm.weight"))
        partial = y if partial is None else t("add", partial, y)
        h = mix(blocks, partial, p + "mlp_res.")
        partial = t("add", partial, t("ffn", l, norm(h, p + "post_attention_layernorm.weight")))
    out = mix(blocks, partial, "output_attn_res.")
    return t("lm_head", norm(out, "norm.weight"), P("lm_head.weight"))


def residual_pseudo_code(spec, t: Terms):
    P = lambda name: t("param", name)                                         # noqa: E731
    h = t("embedding", t("input", "input_ids"), P("embed_tokens.weight"))
    for l in range(spec.num_layers):
        p = f"layers.{l}."
        h = t("add", h, t("attn", l, t("rmsnorm", h, P(p + "input_layernorm.weight"))))
        h = t("add", h, t("ffn", l, t("rmsnorm", h, P(p + "post_attention_layernorm.weight"))))
    return t("lm_head", t("rmsnorm", h, P("norm.weight")), P("lm_head.weight"))


def _variants():
    tiny = example_spec("k3-tiny.yaml")
    out = [(n, example_spec(n)) for n in EXAMPLES]
    for size in (1, 2, 4, 8):
        out.append((f"k3-tiny block {size}", tiny.replace(attn_res=AttnResSpec(block_size=size))))
    out.append(("k3-tiny no attn_res", tiny.replace(attn_res=None)))
    return out


@pytest.mark.parametrize("label, spec", _variants(), ids=lambda v: v if isinstance(v, str) else "")
def test_dataflow_follows_the_pseudo_code(label, spec):
    m = spec_to_module(spec)
    verify(m)
    t = Terms()
    expected = k3_pseudo_code(spec, t) if spec.attn_res else residual_pseudo_code(spec, t)
    assert evaluate(m, t) == expected


@pytest.mark.parametrize("name", EXAMPLES)
def test_weights_are_the_canonical_table(name):
    spec, m = example_spec(name), example_module(name)
    table = weight_table(spec)
    params = m.params()
    assert len(params) == sum(op.op == "param" for op in m.ops)       # each weight declared once
    unused = {f"layers.0.self_attention_res.{w}" for w in ("proj_weight", "norm_weight")} if spec.attn_res else set()
    assert set(params) == set(table) - unused
    for wname, op in params.items():
        info = table[wname]
        assert op.type == TensorType("f32" if info.dtype == "fp32" else "bf16", info.shape), wname


def test_fp32_weights():
    m = example_module("k3-tiny.yaml")
    f32 = sorted({n.rsplit(".", 1)[-1] for n, op in m.params().items() if op.type.dtype == "f32"})
    assert f32 == ["A_log", "dt_bias", "e_score_correction_bias"]


def test_layer_ops_and_attrs(in_root):
    from k3c.frontend import load_spec

    spec = load_spec("examples/kimi-k3.yaml")
    m = spec_to_module(spec)
    kda = [op.attr("layer") for op in m.ops if op.op == "kda"]
    mla = [op.attr("layer") for op in m.ops if op.op == "mla"]
    assert kda == [i for i, k in enumerate(spec.layer_kinds) if k == "kda"] and len(kda) == 69
    assert mla[:2] == [3, 7] and mla[-2:] == [91, 92] and len(mla) == 24          # 1-based 4, 8, ..., 92, 93
    assert [op.attr("layer") for op in m.ops if op.op == "mlp"] == [0]
    first_kda = next(op for op in m.ops if op.op == "kda")
    assert first_kda.attr_dict == {"layer": 0, "num_heads": 96, "head_dim": 128, "conv_kernel": 4, "gate": "safe",
                                   "gate_lower_bound": -5.0, "output_gate": "full_rank", "norm_eps": 1e-5,
                                   "l2norm_eps": 1e-6}
    moe = next(op for op in m.ops if op.op == "moe")
    assert moe.attr("top_k") == 16 and moe.attr("latent_dim") == 3584 and moe.attr("activation") == "situ"
    assert moe.attr("situ_beta_up") == 25.0
    mixes = [op for op in m.ops if op.op == "attn_res_mix"]
    assert len(mixes) == 2 * 93 - 1 + 1                       # every sublayer but layer 0's attention, plus out
    assert mixes[-1].attr("sublayer") == "out" and mixes[-1].attr("num_sources") == 9   # 8 blocks + embedding
    assert m.outputs == ("logits",) and m.type_of("logits") == TensorType("bf16", ("B", "T", 163840))


def test_locs_point_at_the_yaml(in_root):
    from k3c.frontend import load_spec

    spec = load_spec("examples/k3-tiny.yaml")
    m = spec_to_module(spec)
    lines = open("examples/k3-tiny.yaml").read().splitlines()

    def line_of(op):
        file, _, line = op.loc.rpartition(":")
        assert file == "examples/k3-tiny.yaml"
        return lines[int(line) - 1].strip()

    assert all(op.loc for op in m.ops)
    by = {op.op: op for op in m.ops}
    assert line_of(by["kda"]) == "kda:" and line_of(by["mla"]) == "mla:" and line_of(by["moe"]) == "moe:"
    assert line_of(by["attn_res_mix"]).startswith("block_size:")
    assert line_of(by["rmsnorm"]).startswith("rms_norm_eps:")
    assert line_of(by["mlp"]).startswith("dense_intermediate_size:")
    conv = next(op for op in m.ops if op.op == "param" and op.attr("name").endswith("q_conv1d.weight"))
    assert line_of(conv).startswith("conv_kernel:")
    bias = next(op for op in m.ops if op.op == "param" and op.attr("name").endswith("e_score_correction_bias"))
    assert line_of(bias).startswith("router_bias:")


def test_tied_embeddings_and_all_dense():
    spec = example_spec("k3-tiny.yaml")
    spec = spec.replace(tie_word_embeddings=True,
                        mlp=dataclasses.replace(spec.mlp, moe=None, dense_layers=tuple(range(spec.num_layers))))
    m = verify(spec_to_module(spec))
    head = next(op for op in m.ops if op.op == "lm_head")
    assert head.attr("tied") is True and "lm_head.weight" not in m.params()
    assert m.defs[head.inputs[1]].attr("name") == "embed_tokens.weight"
    assert not m.ops_named("moe") and len(m.ops_named("mlp")) == spec.num_layers
    assert isinstance(spec.mlp, MLPSpec)
