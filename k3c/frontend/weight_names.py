"""Canonical weight names and shapes of a spec: the K3 checkpoint layout (K3.md section 8) without the
`language_model.model.` prefix. Every part of k3c (IR params, reference, loaders, quantization patterns) uses these.

Linear weights are [out_features, in_features] as in torch.nn.Linear. Layer indices are 0-based. Routed experts are
held stacked, `layers.{i}.block_sparse_moe.experts.w1` of shape [E, out, in] (w1 = gate, w3 = up, w2 = down), which
is what grouped kernels consume; checkpoints store them per expert as `experts.{e}.w1.weight`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .spec import ModelSpec

K3_CHECKPOINT_PREFIX = "language_model.model."   # K3 checkpoint names: this + the canonical name (experts per expert)
K3_LM_HEAD = "language_model.lm_head"            # the K3 checkpoint's lm_head module, outside that prefix


@dataclass(frozen=True)
class WeightInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str          # "float" = the model's parameter dtype (bf16 or fp32); "fp32" = always fp32
    kind: str           # linear | norm | embedding | conv | vector | attnres | experts


def _lin(name: str, out_f: int, in_f: int) -> WeightInfo:
    return WeightInfo(name, (out_f, in_f), "float", "linear")


def _norm(name: str, n: int) -> WeightInfo:
    return WeightInfo(name, (n,), "float", "norm")


def kda_weights(spec: ModelSpec, p: str) -> list[WeightInfo]:
    k, d = spec.kda, spec.hidden_size
    w, h = k.width, k.num_heads
    out = [_lin(f"{p}q_proj.weight", w, d), _lin(f"{p}k_proj.weight", w, d), _lin(f"{p}v_proj.weight", w, d)]
    out += [WeightInfo(f"{p}{c}_conv1d.weight", (w, 1, k.conv_kernel), "float", "conv") for c in "qkv"]
    out += [_lin(f"{p}f_a_proj.weight", k.forget_rank, d), _lin(f"{p}f_b_proj.weight", w, k.forget_rank),
            _lin(f"{p}b_proj.weight", h, d)]
    if k.output_gate == "full_rank":
        out.append(_lin(f"{p}g_proj.weight", w, d))
    else:
        out += [_lin(f"{p}g_a_proj.weight", k.out_gate_rank, d), _lin(f"{p}g_b_proj.weight", w, k.out_gate_rank)]
    out += [WeightInfo(f"{p}A_log", (h,), "fp32", "vector"), WeightInfo(f"{p}dt_bias", (w,), "fp32", "vector"),
            _norm(f"{p}o_norm.weight", k.head_dim), _lin(f"{p}o_proj.weight", d, w)]
    return out


def mla_weights(spec: ModelSpec, p: str) -> list[WeightInfo]:
    m, d = spec.mla, spec.hidden_size
    n = m.num_heads
    out = []
    if m.q_lora_rank is None:
        out.append(_lin(f"{p}q_proj.weight", n * m.qk_head_dim, d))
    else:
        out += [_lin(f"{p}q_a_proj.weight", m.q_lora_rank, d), _norm(f"{p}q_a_layernorm.weight", m.q_lora_rank),
                _lin(f"{p}q_b_proj.weight", n * m.qk_head_dim, m.q_lora_rank)]
    out += [_lin(f"{p}kv_a_proj_with_mqa.weight", m.cache_width, d),
            _norm(f"{p}kv_a_layernorm.weight", m.kv_lora_rank),
            _lin(f"{p}kv_b_proj.weight", n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)]
    if m.output_gate:
        out.append(_lin(f"{p}g_proj.weight", n * m.v_head_dim, d))
    out.append(_lin(f"{p}o_proj.weight", d, n * m.v_head_dim))
    return out


def mlp_weights(spec: ModelSpec, p: str, width: int) -> list[WeightInfo]:
    d = spec.hidden_size
    return [_lin(f"{p}gate_proj.weight", width, d), _lin(f"{p}up_proj.weight", width, d),
            _lin(f"{p}down_proj.weight", d, width)]


def moe_weights(spec: ModelSpec, p: str) -> list[WeightInfo]:
    e, d = spec.mlp.moe, spec.hidden_size
    z = e.latent_dim or d
    out = [_lin(f"{p}gate.weight", e.num_experts, d)]
    if e.router_bias:
        out.append(WeightInfo(f"{p}gate.e_score_correction_bias", (e.num_experts,), "fp32", "vector"))
    # routed experts are stacked [E, out, in]; checkpoints hold them per expert (see expert_checkpoint_names)
    m, n = e.expert_intermediate_size, e.num_experts
    out += [WeightInfo(f"{p}experts.w1", (n, m, z), "float", "experts"),
            WeightInfo(f"{p}experts.w3", (n, m, z), "float", "experts"),
            WeightInfo(f"{p}experts.w2", (n, z, m), "float", "experts")]
    if e.num_shared_experts:
        out += mlp_weights(spec, f"{p}shared_experts.", e.shared_width)
    if e.latent_dim is not None:
        out.append(_lin(f"{p}routed_expert_down_proj.weight", e.latent_dim, d))
        if e.latent_norm:
            out.append(_norm(f"{p}routed_expert_norm.weight", e.latent_dim))
        out.append(_lin(f"{p}routed_expert_up_proj.weight", d, e.latent_dim))
    return out


def attnres_weights(spec: ModelSpec, p: str) -> list[WeightInfo]:
    d = spec.hidden_size
    return [WeightInfo(f"{p}proj_weight", (d,), "float", "attnres"),
            WeightInfo(f"{p}norm_weight", (d,), "float", "norm")]


def layer_weights(spec: ModelSpec, i: int) -> list[WeightInfo]:
    p = f"layers.{i}."
    d = spec.hidden_size
    out = [_norm(f"{p}input_layernorm.weight", d), _norm(f"{p}post_attention_layernorm.weight", d)]
    attn = kda_weights if spec.layer_kinds[i] == "kda" else mla_weights
    out += attn(spec, f"{p}self_attn.")
    if spec.is_moe_layer(i):
        out += moe_weights(spec, f"{p}block_sparse_moe.")
    else:
        out += mlp_weights(spec, f"{p}mlp.", spec.mlp.dense_intermediate_size)
    if spec.attn_res is not None:
        out += attnres_weights(spec, f"{p}self_attention_res.") + attnres_weights(spec, f"{p}mlp_res.")
    return out


def model_weights(spec: ModelSpec) -> list[WeightInfo]:
    """Every weight of the model, in a stable order."""
    d = spec.hidden_size
    out = [WeightInfo("embed_tokens.weight", (spec.vocab_size, d), "float", "embedding")]
    for i in range(spec.num_layers):
        out += layer_weights(spec, i)
    if spec.attn_res is not None:
        out += attnres_weights(spec, "output_attn_res.")
    out.append(_norm("norm.weight", d))
    if not spec.tie_word_embeddings:
        out.append(_lin("lm_head.weight", spec.vocab_size, d))
    return out


def weight_table(spec: ModelSpec) -> dict[str, WeightInfo]:
    return {w.name: w for w in model_weights(spec)}


def expert_checkpoint_names(stacked_name: str, num_experts: int) -> list[str]:
    """`layers.3.block_sparse_moe.experts.w1` -> [`layers.3.block_sparse_moe.experts.0.w1.weight`, ...]."""
    prefix, _, proj = stacked_name.rpartition(".")
    return [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts)]
