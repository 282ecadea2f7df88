"""HF config.json import: published configs equal the example YAML specs; errors name file, line and key."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from k3c.errors import SpecError
from k3c.frontend import load_spec
from k3c.frontend.hf_config import SUPPORTED_MODEL_TYPES, spec_from_hf_config_text
from k3c.frontend.hf_export import spec_to_hf_config
from k3c.frontend.quant_check import quantized_weight_names
from k3c.frontend.spec import DEFAULT_MXFP4_INCLUDE

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"

K3_JSON = DATA / "kimi_k3_config.json"
KL_JSON = DATA / "kimi_linear_48b_config.json"            # KimiLinearConfig(...).save_pretrained (transformers 5)
KL_HUB_JSON = DATA / "kimi_linear_48b_hub_config.json"    # the hub's original form (linear_attn_config, ...)


def k3_data() -> dict:
    return json.loads(K3_JSON.read_text())


def kl_data() -> dict:
    return json.loads(KL_HUB_JSON.read_text())


def load(data: dict, name: str = "config.json"):
    return spec_from_hf_config_text(json.dumps(data, indent=2), name)


def error_of(data: dict | str) -> SpecError:
    text = data if isinstance(data, str) else json.dumps(data, indent=2)
    with pytest.raises(SpecError) as info:
        spec_from_hf_config_text(text, "cfg.json")
    return info.value


def line_of(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


# -- published configs == example specs --------------------------------------------------------------------------
def test_k3_config_equals_example():
    spec = load_spec(K3_JSON)
    expected = load_spec(ROOT / "examples" / "kimi-k3.yaml")
    assert spec.name == "kimi_k3_config"                  # no _name_or_path: the file name
    assert spec.replace(name=expected.name) == expected
    assert spec.num_layers == 93 and spec.layer_kinds.count("mla") == 24
    assert spec.layer_kinds[3] == "mla" and spec.layer_kinds[92] == "mla" and spec.layer_kinds[91] == "mla"


@pytest.mark.parametrize("path", [KL_JSON, KL_HUB_JSON], ids=["transformers-saved", "hub"])
def test_kimi_linear_48b_config_equals_example(path):
    spec = load_spec(path)
    expected = load_spec(ROOT / "examples" / "kimi-linear-48b.yaml")
    assert spec.replace(name=expected.name) == expected


def test_locations_point_into_the_json():
    text = K3_JSON.read_text()
    spec = load_spec(K3_JSON)
    assert spec.source == str(K3_JSON)
    for field, needle in [("kda.num_heads", '"num_heads": 96'), ("moe.latent_dim", '"routed_expert_hidden_size"'),
                          ("attn_res.block_size", '"attn_res_block_size"'), ("layers.kinds", '"full_attn_layers"')]:
        assert spec.loc(field) == f"{K3_JSON}:{line_of(text, needle)}", field


def test_model_dir_and_name_or_path(tmp_path):
    d = tmp_path / "My-Model"
    d.mkdir()
    (d / "config.json").write_text(K3_JSON.read_text())
    assert load_spec(d).name == "My-Model"
    data = k3_data()
    data["_name_or_path"] = "moonshotai/Kimi-K3"
    assert load(data).name == "Kimi-K3"


@pytest.mark.parametrize("example", ["kimi-k3", "kimi-linear-48b", "k3-tiny"])
def test_export_round_trip(example):
    spec = load_spec(ROOT / "examples" / f"{example}.yaml")
    config = spec_to_hf_config(spec)
    assert config["model_type"] == "kimi_k3" and "text_config" in config
    again = spec_from_hf_config_text(json.dumps(config, indent=2), "rt.json")
    assert again == spec
    assert again.name == spec.name


def test_flat_k3_config_and_aliases():
    data = k3_data()
    flat = dict(data["text_config"], model_type="kimi_k3")
    spec = load(flat)
    # aliases: num_experts / num_experts_per_token / num_shared_experts / linear_* at top level, situ_beta_*
    tc = copy.deepcopy(data["text_config"])
    lin = tc.pop("linear_attn_config")
    tc["num_experts"] = tc.pop("n_routed_experts")
    tc["num_experts_per_token"] = tc.pop("num_experts_per_tok")
    tc["num_shared_experts"] = tc.pop("n_shared_experts")
    tc["linear_num_heads"], tc["linear_head_dim"] = lin["num_heads"], lin["head_dim"]
    tc["linear_conv_kernel_dim"] = lin["short_conv_kernel_size"]
    tc["gate_lower_bound"], tc["use_full_rank_gate"] = lin["gate_lower_bound"], lin["use_full_rank_gate"]
    tc["full_attn_layers"] = lin["full_attn_layers"]
    tc["situ_beta_gate"], tc["situ_beta_up"] = tc.pop("situ_betas")
    assert load({"model_type": "kimi_k3", "text_config": tc}) == spec


def test_k3_feature_switches():
    data = k3_data()
    tc = data["text_config"]
    tc["linear_attn_config"]["gate_lower_bound"] = None
    tc["linear_attn_config"]["use_full_rank_gate"] = False
    tc["mla_use_output_gate"] = False
    tc["attn_res_block_size"] = None
    tc["routed_expert_hidden_size"] = None
    tc["latent_moe_use_norm"] = False
    tc["hidden_act"] = "silu"
    del tc["situ_betas"]
    del tc["quantization_config"]
    spec = load(data)
    assert spec.kda.gate == "softplus" and spec.kda.output_gate == "low_rank" and spec.kda.output_gate_rank == 128
    assert not spec.mla.output_gate and spec.attn_res is None and spec.mlp.moe.latent_dim is None
    assert spec.mlp.activation.kind == "swiglu" and spec.precision.weights.format == "bf16"
    tc["linear_attn_config"]["safe_gate"] = True            # GLM5-style: safe gate without a bound = -5
    assert load(data).kda.gate_lower_bound == -5.0


# -- Kimi Linear: transformers' semantics ------------------------------------------------------------------------
def test_kimi_linear_defaults_follow_transformers():
    from transformers import KimiLinearConfig

    spec = load({"model_type": "kimi_linear"})
    hf = KimiLinearConfig()
    assert [("mla" if t == "full_attention" else "kda") for t in hf.layer_types] == list(spec.layer_kinds)
    assert [i for i, t in enumerate(hf.mlp_layer_types) if t == "dense"] == list(spec.mlp.dense_layers)
    assert spec.mlp.moe.num_experts == hf.num_local_experts and spec.mlp.moe.top_k == hf.num_experts_per_tok
    assert spec.mlp.moe.routed_scaling_factor == hf.routed_scaling_factor
    # transformers' default layout (full attention at 0-based 4, 8, ...) is NOT the published 48B layout
    assert spec.layer_kinds != load_spec(KL_JSON).layer_kinds


@pytest.mark.parametrize("variant", range(4))
def test_kimi_linear_layouts_agree_with_transformers(variant):
    from transformers import KimiLinearConfig

    n = 7
    data = {"model_type": "kimi_linear", "num_hidden_layers": n, "hidden_size": 64, "vocab_size": 100,
            "pad_token_id": 0}
    if variant == 0:
        data["linear_attn_config"] = {"full_attn_layers": [2, 7], "kda_layers": [1, 3, 4, 5, 6], "num_heads": 3,
                                      "head_dim": 16, "short_conv_kernel_size": 3}
        data["first_k_dense_replace"] = 2
    elif variant == 1:
        data["layer_types"] = ["full_attention"] + ["linear_attention"] * 6
        data["mlp_layer_types"] = ["sparse", "dense", "sparse", "sparse", "dense", "sparse", "sparse"]
    elif variant == 2:
        data["linear_attn_config"] = {"full_attn_layers": [3]}    # transformers needs both lists: ignored
        data["first_k_dense_replace"] = 0
    else:
        data.update(num_experts=16, num_experts_per_token=4, num_shared_experts=2, moe_renormalize=False,
                    linear_num_heads=5, model_max_length=4096)
    spec = load(data)
    hf = KimiLinearConfig(**{k: v for k, v in data.items() if k != "model_type"})
    assert [("mla" if t == "full_attention" else "kda") for t in hf.layer_types] == list(spec.layer_kinds)
    assert [i for i, t in enumerate(hf.mlp_layer_types) if t == "dense"] == list(spec.mlp.dense_layers)
    assert (spec.kda.num_heads, spec.kda.head_dim, spec.kda.conv_kernel) == (
        hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim)
    moe = spec.mlp.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.renormalize) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.n_shared_experts, hf.norm_topk_prob)
    assert spec.max_context == hf.max_position_embeddings


# -- quantization_config ------------------------------------------------------------------------------------------
def test_quantization_scopes():
    data = k3_data()
    spec = load(data)
    assert spec.precision.weights.include == DEFAULT_MXFP4_INCLUDE and spec.precision.activations == "mxfp8"
    q = data["text_config"]["quantization_config"]
    q["ignore"].append("re:.*layers\\.5\\.block_sparse_moe\\.experts\\..*")
    spec = load(data)
    assert spec.precision.weights.exclude == ("layers.5.block_sparse_moe.experts.*",)
    assert "layers.5.block_sparse_moe.experts.w1" not in quantized_weight_names(spec)
    assert "layers.6.block_sparse_moe.experts.w1" in quantized_weight_names(spec)
    # round trip of a non-default scope
    assert load(spec_to_hf_config(spec)) == spec.replace(name=spec.name)
    del q["config_groups"]["group_0"]["input_activations"]
    assert load(data).precision.activations == "bf16"
    q["ignore"] = ["lm_head"]                                  # every Linear but the head: not just experts
    spec = load(data)
    names = quantized_weight_names(spec)
    assert "layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert load(spec_to_hf_config(spec)) == spec


def test_quantization_errors():
    data = k3_data()
    data["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    assert "MXFP4 only" in error_of(data).message
    data = k3_data()
    data["text_config"]["quantization_config"]["quant_method"] = "fp8"
    assert "compressed-tensors" in error_of(data).message


# -- errors ------------------------------------------------------------------------------------------------------
def test_invalid_json_names_line_and_column():
    text = '{\n  "model_type": "kimi_k3",\n  "text_config": {\n    "hidden_size": 64,,\n  }\n}\n'
    err = error_of(text)
    assert err.file == "cfg.json" and err.line == 4 and "column" in err.message


def test_unknown_model_type_lists_supported():
    err = error_of({"model_type": "deepseek_v3"})
    assert err.field == "model_type" and err.line == 2
    for mt in SUPPORTED_MODEL_TYPES:
        assert mt in err.message
    assert "did you mean 'kimi_linear'" in error_of({"model_type": "kimi_linaer"}).message
    assert "model_type" in error_of({"hidden_size": 3}).message


def test_wrong_type_names_json_key_and_line():
    data = k3_data()
    data["text_config"]["hidden_size"] = "7168"
    text = json.dumps(data, indent=2)
    err = error_of(text)
    assert err.field == "text_config.hidden_size" and err.line == line_of(text, '"hidden_size": "7168"')
    assert "integer" in err.message


def test_cross_field_error_is_relocated():
    data = k3_data()
    data["text_config"]["num_experts_per_tok"] = 1000
    text = json.dumps(data, indent=2)
    err = error_of(text)
    assert err.field == "text_config.num_experts_per_tok" and err.line == line_of(text, '"num_experts_per_tok"')


def test_grouped_routing_is_unsupported():
    data = kl_data()
    data["num_expert_group"], data["topk_group"] = 8, 4
    err = error_of(data)
    assert err.field == "num_expert_group" and "grouped" in err.message and "not supported" in err.message
    data["topk_group"] = 8                                        # every group selected: same as ungrouped
    assert load(data).mlp.moe.num_experts == 256


@pytest.mark.parametrize("mutate,field,words", [
    (lambda d: d["text_config"]["linear_attn_config"].__setitem__("full_attn_layers", [0, 4]),
     "text_config.linear_attn_config.full_attn_layers", "out of range"),
    (lambda d: d["text_config"]["linear_attn_config"]["kda_layers"].append(4),
     "text_config.linear_attn_config.kda_layers", "both"),
    (lambda d: d["text_config"].__setitem__("mla_use_output_gat", d["text_config"].pop("mla_use_output_gate")),
     "text_config.mla_use_output_gat",
     "did you mean 'mla_use_output_gate'"),
    (lambda d: d["text_config"].__setitem__("mla_use_nope", False), "text_config.mla_use_nope", "NoPE"),
    (lambda d: d["text_config"].__setitem__("num_key_value_heads", 8), "text_config.num_key_value_heads",
     "num_key_value_heads"),
    (lambda d: d["text_config"].__setitem__("hidden_act", "gelu"), "text_config.hidden_act", "unsupported"),
    (lambda d: d["text_config"].pop("first_k_dense_replace"), "text_config", "first_k_dense_replace"),
    (lambda d: d["text_config"].pop("hidden_size"), "text_config", "hidden_size"),
    (lambda d: d["text_config"].__setitem__("n_shared_experts", 1.5), "text_config.n_shared_experts", "integer"),
])
def test_k3_errors(mutate, field, words):
    data = k3_data()
    mutate(data)
    err = error_of(data)
    assert err.field == field and words in err.message and err.line is not None


@pytest.mark.parametrize("key,value", [("mla_use_output_gate", True), ("routed_expert_hidden_size", 1024),
                                       ("attn_res_block_size", 4), ("hidden_act", "situ"),
                                       ("attention_bias", True)])
def test_kimi_linear_rejects_what_transformers_cannot_run(key, value):
    data = kl_data()
    data[key] = value
    err = error_of(data)
    assert err.field == key


def test_layer_types_errors():
    data = {"model_type": "kimi_linear", "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "full_atention", "linear_attention"]}
    text = json.dumps(data, indent=2)
    err = error_of(text)
    assert err.field == "layer_types" and err.line == line_of(text, '"full_atention"')
    assert "did you mean 'full_attention'" in err.message
    data["layer_types"] = ["linear_attention"] * 2
    assert "num_hidden_layers is 3" in error_of(data).message


def test_duplicate_key():
    err = error_of('{\n "model_type": "kimi_linear",\n "model_type": "kimi_k3"\n}')
    assert err.line == 3 and "duplicate" in err.message


def test_nan_is_not_json():
    assert "not valid JSON" in error_of('{"model_type": "kimi_linear", "rms_norm_eps": NaN}').message


def test_messages_stay_on_one_line():
    err = error_of({"model_type": "kimi_k3\nx"})
    assert "\n" not in str(err)
    data = k3_data()
    data["text_config"]["hidden_size\n"] = 3
    data["text_config"].pop("hidden_size")
    assert "\n" not in str(error_of(data))


def test_activation_only_quantization_round_trips():
    spec = load_spec(ROOT / "examples" / "kimi-linear-48b.yaml")
    spec = spec.replace(precision=spec.precision.__class__(activations="mxfp8"))
    config = spec_to_hf_config(spec)
    assert "weights" not in config["text_config"]["quantization_config"]["config_groups"]["group_0"]
    assert load(config) == spec
    rceil = load_spec(ROOT / "examples" / "k3-tiny.yaml")
    rceil = rceil.replace(precision=rceil.precision.__class__(
        weights=rceil.precision.weights.__class__(format="mxfp4", include=DEFAULT_MXFP4_INCLUDE, scale_rule="rceil"),
        activations="bf16"))
    assert load(spec_to_hf_config(rceil)) == rceil
