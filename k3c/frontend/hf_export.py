"""Hugging Face export: a ModelSpec as a K3-layout `config.json` (model_type kimi_k3, the model's fields in
`text_config`), with its precision plan as a compressed-tensors `quantization_config`. The inverse of hf_config's
import (docs/hf-import.md).
"""
from __future__ import annotations

import re
from typing import Any

from .quant_check import expert_stack_names, quantizable_names, quantized_weight_names, weight_families
from .spec import ModelSpec
from .weight_names import K3_CHECKPOINT_PREFIX, K3_LM_HEAD


def spec_to_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A K3-layout config.json (model_type kimi_k3, fields in `text_config`) that imports back to `spec`.

    `spec_from_hf_config_text(json.dumps(spec_to_hf_config(s)), p) == s` for every spec whose KDA ranks are explicit
    (the importer always sets gate_rank/output_gate_rank) and whose precision patterns are in canonical form.
    """
    n = spec.num_layers
    tc: dict[str, Any] = {
        "model_type": "kimi_k3_text",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": n,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_context,
        "tie_word_embeddings": spec.tie_word_embeddings,
    }
    lin: dict[str, Any] = {
        "full_attn_layers": [i + 1 for i in range(n) if spec.layer_kinds[i] == "mla"],
        "kda_layers": [i + 1 for i in range(n) if spec.layer_kinds[i] == "kda"],
    }
    if spec.kda is not None:
        k = spec.kda
        lin.update({"num_heads": k.num_heads, "head_dim": k.head_dim, "short_conv_kernel_size": k.conv_kernel,
                    "gate_lower_bound": k.gate_lower_bound if k.gate == "safe" else None,
                    "use_full_rank_gate": k.output_gate == "full_rank"})
        if k.gate_rank is not None and k.gate_rank != k.head_dim:
            lin["forget_gate_rank"] = k.gate_rank
        if k.output_gate == "low_rank" and k.output_gate_rank is not None and k.output_gate_rank != k.head_dim:
            lin["output_gate_rank"] = k.output_gate_rank
    tc["linear_attn_config"] = lin
    if spec.mla is not None:
        m = spec.mla
        tc.update({"num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
                   "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
                   "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
                   "v_head_dim": m.v_head_dim, "mla_use_nope": True, "mla_use_output_gate": m.output_gate})
    mlp = spec.mlp
    tc["mlp_layer_types"] = ["dense" if not spec.is_moe_layer(i) else "sparse" for i in range(n)]
    if mlp.dense_layers and list(mlp.dense_layers) == list(range(len(mlp.dense_layers))) and mlp.moe is not None:
        tc["first_k_dense_replace"] = len(mlp.dense_layers)
        del tc["mlp_layer_types"]
    elif mlp.moe is not None and not mlp.dense_layers:
        tc["first_k_dense_replace"] = 0
        del tc["mlp_layer_types"]
    if mlp.dense_layers or mlp.moe is None:
        tc["intermediate_size"] = mlp.dense_intermediate_size
    act = mlp.activation
    tc["hidden_act"] = "situ" if act.kind == "situ" else "silu"
    if act.kind == "situ":
        tc["situ_betas"] = [act.situ_beta_gate, act.situ_beta_up]
    if mlp.moe is not None:
        e = mlp.moe
        tc.update({"n_routed_experts": e.num_experts, "num_experts_per_tok": e.top_k,
                   "n_shared_experts": e.num_shared_experts, "moe_intermediate_size": e.expert_intermediate_size,
                   "routed_expert_hidden_size": e.latent_dim, "latent_moe_use_norm": e.latent_norm,
                   "moe_router_activation_func": e.router_activation, "moe_router_bias": e.router_bias,
                   "norm_topk_prob": e.renormalize, "routed_scaling_factor": e.routed_scaling_factor,
                   "n_group": 1, "topk_group": 1})
        if e.shared_intermediate_size is not None:
            tc["shared_expert_intermediate_size"] = e.shared_intermediate_size
    tc["attn_res_block_size"] = spec.attn_res.block_size if spec.attn_res is not None else None
    q = _export_quantization(spec)
    if q is not None:
        tc["quantization_config"] = q
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "_name_or_path": spec.name,
            "text_config": tc}


def _module_regex(canon: str) -> str:
    """Canonical weight name (layer index may be '*') -> a compressed-tensors 're:' target over module names."""
    base = canon[: -len(".weight")] if canon.endswith(".weight") else canon
    if base == "lm_head":
        return "re:^" + re.escape(K3_LM_HEAD) + "$"
    parts = []
    for piece in base.split("."):
        parts.append(r"\d+" if piece == "*" else re.escape(piece))
    body = r"\.".join(parts)
    m = re.match(r"^(.*experts)\\\.(w[123])$", body)
    if m:
        body = m.group(1) + r"\.\d+\." + m.group(2)
    return "re:^" + re.escape(K3_CHECKPOINT_PREFIX) + body + "$"


_MXFP8_ACTS = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
               "dynamic": True}


def _export_quantization(spec: ModelSpec) -> dict | None:
    w = spec.precision.weights
    quantized = quantized_weight_names(spec)
    act = spec.precision.activations
    if not quantized and act == "bf16":
        return None
    if not quantized:                                      # MXFP8 activations only: a group without weights
        return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": dict(_MXFP8_ACTS)}},
                "ignore": []}
    families = weight_families(quantizable_names(spec))
    targets: list[str] = []
    if quantized == expert_stack_names(spec):
        families = {}                                      # exactly the routed experts: one target
        targets.append("re:^" + re.escape(K3_CHECKPOINT_PREFIX) + r"layers\.\d+\.block_sparse_moe\.experts\.\d+\."
                       r"w[123]$")
    for fam, members in families.items():
        q = [n for n in members if n in quantized]
        if len(q) == len(members):
            targets.append(_module_regex(fam))
        else:
            targets += [_module_regex(n) for n in q]
    weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
               "dynamic": False, "scale_dtype": "float8_e8m0fnu"}
    if w.scale_rule != "floor":
        weights["scale_rule"] = w.scale_rule
    group: dict[str, Any] = {"targets": targets, "weights": weights}
    if act == "mxfp8":
        group["input_activations"] = dict(_MXFP8_ACTS)
    # packed only when the spec quantizes (its graph reads packed experts); else the checkpoint holds floats
    fmt = "mxfp4-pack-quantized" if spec.quantization is not None else "dense"
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, "ignore": []}
