"""Layer by layer against transformers' pure-PyTorch Kimi Linear (the public reference of KDA with the softplus
gate and low-rank output gate, ungated NoPE MLA and the sigmoid-router MoE). K3-only features (safe gate, full-rank
gate, MLA output gate, LatentMoE, AttnRes) have no outside implementation: they are checked in the other files."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from k3c.reference import kda_layer, mla_layer, moe_layer, strip_prefix
from k3c.runtime.weights import init_weights
from refutil import randn, rel_err

# transformers switches Kimi Linear to fla's GPU kernels when fla imports; keep it on the PyTorch path (the
# project-wide convention; fla's naive KDA is loaded by file path in refutil, unaffected)
sys.modules["fla"] = None
kl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
KimiLinearConfig = pytest.importorskip("transformers.models.kimi_linear.configuration_kimi_linear").KimiLinearConfig


@pytest.fixture(scope="module")
def setup(plain_spec):
    # Kimi Linear ties both low ranks to head_dim and uses a kernel-4 conv
    spec = plain_spec.replace(kda=dataclasses.replace(plain_spec.kda, conv_kernel=4, output_gate_rank=None))
    kda, mla, moe = spec.kda, spec.mla, spec.mlp.moe
    cfg = KimiLinearConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        rms_norm_eps=spec.rms_norm_eps, linear_num_heads=kda.num_heads, linear_head_dim=kda.head_dim,
        linear_conv_kernel_dim=kda.conv_kernel, num_attention_heads=mla.num_heads, num_key_value_heads=mla.num_heads,
        q_lora_rank=None, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, num_experts=moe.num_experts,
        num_experts_per_token=moe.top_k, moe_intermediate_size=moe.expert_intermediate_size,
        num_shared_experts=moe.num_shared_experts, routed_scaling_factor=moe.routed_scaling_factor,
        moe_renormalize=True, n_group=1, topk_group=1, hidden_act="silu",
        intermediate_size=spec.mlp.dense_intermediate_size)
    cfg._attn_implementation = "eager"
    return spec, cfg, init_weights(spec, seed=21)


def load(module, tensors):
    state = module.state_dict()
    for k, v in tensors.items():
        assert state[k].shape == v.shape, k
        state[k] = v
    module.load_state_dict(state)
    return module.eval()


def test_kda_layer_matches_transformers(setup):
    spec, cfg, w_all = setup
    i = spec.layer_kinds.index("kda")
    w = strip_prefix(w_all, f"layers.{i}.self_attn.")
    hf = load(kl.KimiLinearDeltaAttention(cfg, i), {
        **{f"{c}_proj.weight": w[f"{c}_proj.weight"] for c in "qkvb"},
        "conv1d.weight": torch.cat([w[f"{c}_conv1d.weight"] for c in "qkv"]),
        "forget_gate.f_a_proj.weight": w["f_a_proj.weight"], "forget_gate.f_b_proj.weight": w["f_b_proj.weight"],
        "forget_gate.dt_bias": w["dt_bias"], "forget_gate.A_log": w["A_log"].view(1, 1, -1, 1),
        "g_a_proj.weight": w["g_a_proj.weight"], "g_b_proj.weight": w["g_b_proj.weight"],
        "o_norm.weight": w["o_norm.weight"], "o_proj.weight": w["o_proj.weight"]})
    x = randn(2, 70, spec.hidden_size, seed=22)                   # two chunks of HF's 64, the second partial
    want = hf(x)
    got, _ = kda_layer(x, w, spec.kda, spec.rms_norm_eps)
    assert rel_err(got, want) <= 1e-5


def test_mla_layer_matches_transformers(setup):
    spec, cfg, w_all = setup
    i = spec.layer_kinds.index("mla")
    w = strip_prefix(w_all, f"layers.{i}.self_attn.")
    hf = load(kl.KimiLinearAttention(cfg, i), w)
    x = randn(2, 11, spec.hidden_size, seed=23)
    mask = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    want, _ = hf(x, attention_mask=mask)
    got, _ = mla_layer(x, w, spec.mla)
    assert rel_err(got, want) <= 1e-5


def test_moe_layer_matches_transformers(setup):
    spec, cfg, w_all = setup
    moe = dataclasses.replace(spec.mlp.moe, router_activation="sigmoid", router_bias=True, renormalize=True)
    w = strip_prefix(w_all, "layers.1.block_sparse_moe.")
    w["gate.e_score_correction_bias"] = 0.1 * randn(moe.num_experts, seed=24)
    hf = load(kl.KimiLinearMoE(cfg), {
        "gate.weight": w["gate.weight"], "gate.e_score_correction_bias": w["gate.e_score_correction_bias"],
        "experts.gate_up_proj": torch.cat([w["experts.w1"], w["experts.w3"]], dim=1),
        "experts.down_proj": w["experts.w2"],
        **{f"shared_experts.{k}": w[f"shared_experts.{k}"] for k in
           ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}})
    x = randn(3, 9, spec.hidden_size, seed=25)
    want = hf(x)
    got = moe_layer(x, w, moe, spec.mlp.activation, spec.rms_norm_eps)
    assert rel_err(got, want) <= 1e-5
