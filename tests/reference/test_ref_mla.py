"""Gated NoPE MLA: an independent SDPA formulation, absorbed == MHA, causality, cache append/decode == full."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from k3c.reference import ReferenceModel, mla_latent, mla_layer, rms_norm, strip_prefix
from k3c.runtime.weights import init_weights
from refutil import rand_ids, randn, rel_err


def layer_weights(spec, seed=0):
    i = spec.layer_kinds.index("mla")
    return strip_prefix(init_weights(spec, seed=seed), f"layers.{i}.self_attn.")


def sdpa_mla(x, w, cfg):
    """MLA written out the textbook way: explicit per-head keys [k_nope | k_pe] and SDPA with a causal mask."""
    b, t, _ = x.shape
    n, p, r, dv, lat = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = x @ w["q_proj.weight"].T
    else:
        q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], 1e-6) @ w["q_b_proj.weight"].T
    q = q.view(b, t, n, p + r).transpose(1, 2)
    kv = x @ w["kv_a_proj_with_mqa.weight"].T
    c = rms_norm(kv[..., :lat], w["kv_a_layernorm.weight"], 1e-6)
    k_pe = kv[..., lat:]
    kvb = (c @ w["kv_b_proj.weight"].T).view(b, t, n, p + dv).transpose(1, 2)
    k = torch.cat([kvb[..., :p], k_pe[:, None].expand(b, n, t, r)], dim=-1)
    o = F.scaled_dot_product_attention(q, k, kvb[..., p:], is_causal=True, scale=(p + r) ** -0.5)
    o = o.transpose(1, 2)
    if cfg.output_gate:
        o = o * torch.sigmoid(x @ w["g_proj.weight"].T).view(b, t, n, dv)
    return o.reshape(b, t, n * dv) @ w["o_proj.weight"].T


@pytest.mark.parametrize("variant", ["k3", "plain"])
def test_mla_matches_sdpa_and_absorbed(tiny_spec, plain_spec, variant):
    spec = tiny_spec if variant == "k3" else plain_spec
    w = layer_weights(spec)
    x = randn(2, 13, spec.hidden_size, seed=1)
    want = sdpa_mla(x, w, spec.mla)
    y, cache = mla_layer(x, w, spec.mla)
    assert rel_err(y, want) <= 1e-5
    assert cache.shape == (2, 13, spec.mla.cache_width)
    y_mqa, cache_mqa = mla_layer(x, w, spec.mla, mode="mqa")
    assert rel_err(y_mqa, want) <= 1e-5 and torch.equal(cache, cache_mqa)


def test_mla_latent_is_normed_c_and_raw_k_pe(tiny_spec):
    cfg, w = tiny_spec.mla, layer_weights(tiny_spec)
    x = randn(1, 4, tiny_spec.hidden_size, seed=2)
    lat = mla_latent(x, w, cfg)
    kv = x @ w["kv_a_proj_with_mqa.weight"].T
    assert torch.allclose(lat[..., cfg.kv_lora_rank:], kv[..., cfg.kv_lora_rank:])        # k_pe: never rotated
    assert rel_err(lat[..., :cfg.kv_lora_rank],
                   rms_norm(kv[..., :cfg.kv_lora_rank], w["kv_a_layernorm.weight"], 1e-6)) <= 1e-6


@pytest.mark.parametrize("mode", ["mha", "mqa"])
def test_mla_cache_append_and_decode_equal_full(tiny_spec, mode):
    cfg, w = tiny_spec.mla, layer_weights(tiny_spec, seed=3)
    x = randn(2, 20, tiny_spec.hidden_size, seed=4)
    y_full, cache_full = mla_layer(x, w, cfg, mode=mode)
    ys, cache = [], None
    for a, e in [(0, 9), (9, 10), (10, 11), (11, 20)]:
        y, cache = mla_layer(x[:, a:e], w, cfg, cache, mode=mode)
        ys.append(y)
    assert rel_err(torch.cat(ys, 1), y_full) <= 1e-5
    assert rel_err(cache, cache_full) <= 1e-6


def test_mla_layer_is_causal(tiny_spec):
    cfg, w = tiny_spec.mla, layer_weights(tiny_spec, seed=5)
    x = randn(1, 12, tiny_spec.hidden_size, seed=6)
    x2 = x.clone()
    x2[:, 7] += randn(tiny_spec.hidden_size, seed=7)
    y, _ = mla_layer(x, w, cfg)
    y2, _ = mla_layer(x2, w, cfg)
    assert rel_err(y2[:, :7], y[:, :7]) <= 1e-6
    assert (y2[:, 7:] - y[:, 7:]).norm(dim=-1).min() > 1e-3      # every later position sees the change


@pytest.mark.parametrize("variant", ["k3", "plain"])
def test_model_is_causal(tiny_spec, plain_spec, variant):
    spec = tiny_spec if variant == "k3" else plain_spec
    model = ReferenceModel(spec, init_weights(spec, seed=8), chunk_size=8)
    ids = rand_ids(2, 21, spec.vocab_size, seed=9)
    ids2 = ids.clone()
    ids2[:, 15] = (ids2[:, 15] + 1) % spec.vocab_size
    logits, _ = model.prefill(ids)
    logits2, _ = model.prefill(ids2)
    assert rel_err(logits2[:, :15], logits[:, :15]) <= 1e-5     # fp32 noise only (BLAS blocking by row count)
    assert (logits2[:, 15:] - logits[:, 15:]).norm(dim=-1).min() > 1e-3


def test_gate_and_q_lora_paths_matter(tiny_spec):
    w = layer_weights(tiny_spec, seed=10)
    x = randn(1, 6, tiny_spec.hidden_size, seed=11)
    y, _ = mla_layer(x, w, tiny_spec.mla)
    y_ng, _ = mla_layer(x, w, dataclasses.replace(tiny_spec.mla, output_gate=False))
    assert rel_err(y_ng, y) > 1e-2
