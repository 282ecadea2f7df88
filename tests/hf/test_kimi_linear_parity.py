"""HF import end to end against the outside oracle: transformers' KimiLinearForCausalLM (pure-torch path on CPU).

A small random KimiLinear is saved with save_pretrained (safetensors), imported with k3c.load_spec + load_weights,
and k3c's reference_forward must reproduce transformers' logits (fp32, relative error <= 1e-4). Every weight that
HF initialises to a constant (norm gains, router bias) is randomised so a dropped or mis-mapped tensor shows.
"""
from __future__ import annotations

import importlib
import inspect
import math
import sys

import pytest
import torch

# -- transformers with its pure-torch KDA path, without leaking the fla block to other test modules ----------------
# transformers picks fla's kernels (GPU only) at import time of modeling_kimi_linear when fla is importable; block it
# for that import only, then restore sys.modules exactly (including any copy of the module imported before).
_ABSENT = object()
_saved_fla = sys.modules.get("fla", _ABSENT)
_MOD = "transformers.models.kimi_linear.modeling_kimi_linear"
_saved_mods = {n: sys.modules.pop(n) for n in list(sys.modules) if n == _MOD}
sys.modules["fla"] = None
try:
    hf_kl = importlib.import_module(_MOD)
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
finally:
    if _saved_fla is _ABSENT:
        sys.modules.pop("fla", None)
    else:
        sys.modules["fla"] = _saved_fla
    sys.modules.update(_saved_mods)
_RESTORED = sys.modules.get("fla", _ABSENT) is _saved_fla and all(sys.modules[n] is m for n, m in _saved_mods.items())

from k3c.frontend import load_spec  # noqa: E402
from k3c.runtime.checkpoint import load_weights  # noqa: E402

reference = pytest.importorskip("k3c.reference")

BASE = dict(vocab_size=96, hidden_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
            initializer_range=0.02, hidden_act="silu", num_expert_group=1, topk_group=1)

CONFIGS = {
    # no q_lora, 5 layers, dense layer 0, 6 experts top-2, 1 shared, renormalised, scaled
    "no-q-lora": dict(
        num_hidden_layers=5,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        intermediate_size=96, moe_intermediate_size=24, num_local_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.446),
    # q_lora, MLA first, a dense layer in the middle, v_head_dim != nope, 8 experts top-3, 2 shared, no renorm,
    # conv kernel 3, more KDA heads
    "q-lora": dict(
        num_hidden_layers=4,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
        linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=3,      # 16: the KDA kernels' minimum
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20,
        qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=12,
        intermediate_size=80, moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=3,
        n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.3),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def uses_torch_path() -> bool:
    fn = hf_kl.chunk_kimi_delta_attention
    try:
        return inspect.getclosurevars(fn).nonlocals.get("is_new_implementation") is False
    except (TypeError, ValueError):
        return True


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations everywhere and no constant-initialised tensor left constant."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen)

    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("A_log"):
                t.copy_(torch.empty(t.shape).uniform_(math.log(0.1), math.log(4.0), generator=gen))
            elif name.endswith("dt_bias"):
                t.copy_(randn(t.shape) - 1.0)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.2 * randn(t.shape))
            elif "norm" in name:
                t.copy_(1.0 + 0.2 * randn(t.shape))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(randn(t.shape))
            elif t.dim() >= 2:
                t.copy_(randn(t.shape) / math.sqrt(t.shape[-1]))
            else:
                t.copy_(randn(t.shape))


def build(tmp_path, key: str, seed: int, **overrides):
    torch.manual_seed(seed)
    cfg = KimiLinearConfig(**{**BASE, **CONFIGS[key], **overrides})
    cfg._attn_implementation = "eager"
    model = hf_kl.KimiLinearForCausalLM(cfg).eval()
    randomize(model, seed)
    out = tmp_path / key
    model.save_pretrained(out)          # safetensors, the published (original) tensor names
    return model, out


def test_fla_block_does_not_leak():
    assert _RESTORED                     # (other modules may change sys.modules later; this one left it as found)
    assert uses_torch_path(), "transformers picked fla's kernels; the parity test needs its pure-torch path"


@pytest.mark.parametrize("key,seq,seed", [("no-q-lora", 37, 0), ("q-lora", 71, 1)])
def test_logits_match_transformers(tmp_path, key, seq, seed):
    model, path = build(tmp_path, key, seed)
    assert (path / "model.safetensors").is_file()
    spec = load_spec(path)
    assert spec.mla.q_lora_rank == CONFIGS[key]["q_lora_rank"]
    weights = load_weights(spec, path)
    assert all(t.dtype == torch.float32 for t in weights.values())
    ids = torch.randint(0, BASE["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seed + 10))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    got = reference.reference_forward(spec, weights, ids)
    assert got.shape == expected.shape == (2, seq, BASE["vocab_size"])
    err = rel_err(got, expected)
    print(f"\n{key}: T={seq} relative error {err:.3e}")
    assert err <= 1e-4, f"{key}: relative error {err:.3e} against transformers"


def test_transformers_runtime_names_load_the_same(tmp_path):
    """model.state_dict() names (fused conv1d, forget_gate.*, A_log [1,1,H,1], stacked gate_up_proj) give the same
    canonical tensors as the save_pretrained layout."""
    from safetensors.torch import save_file

    model, path = build(tmp_path, "q-lora", 3)
    spec = load_spec(path)
    a = load_weights(spec, path)
    raw = tmp_path / "raw.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(raw))
    b = load_weights(spec, raw)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sd = model.state_dict()
    m = CONFIGS["q-lora"]["moe_intermediate_size"]
    assert torch.equal(b["layers.2.block_sparse_moe.experts.w3"], sd["model.layers.2.mlp.experts.gate_up_proj"][:, m:])
    assert torch.equal(b["layers.2.block_sparse_moe.experts.w2"], sd["model.layers.2.mlp.experts.down_proj"])
    assert torch.equal(b["layers.1.self_attn.A_log"], sd["model.layers.1.self_attn.forget_gate.A_log"].flatten())
    w = spec.kda.width
    assert torch.equal(b["layers.1.self_attn.k_conv1d.weight"], sd["model.layers.1.self_attn.conv1d.weight"][w:2 * w])


def test_bf16_load(tmp_path):
    _, path = build(tmp_path, "no-q-lora", 4)
    spec = load_spec(path)
    w = load_weights(spec, path, dtype=torch.bfloat16)
    assert w["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert w["layers.0.self_attn.A_log"].dtype == torch.float32            # fp32-kind entries stay fp32
    assert w["layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert w["layers.1.block_sparse_moe.experts.w1"].dtype == torch.bfloat16


def test_tie_word_embeddings_follows_transformers(tmp_path):
    """transformers' KimiLinearForCausalLM never ties lm_head to the embedding (no _tied_weights_keys), whatever
    tie_word_embeddings says; the import follows it so the logits still match."""
    model, path = build(tmp_path, "no-q-lora", 5, tie_word_embeddings=True)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    spec = load_spec(path)
    assert spec.tie_word_embeddings is False
    ids = torch.randint(0, BASE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    assert rel_err(reference.reference_forward(spec, load_weights(spec, path), ids), expected) <= 1e-4
