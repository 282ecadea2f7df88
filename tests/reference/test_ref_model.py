"""The whole model: decode and append-prefill == one prefill, form switches, dtypes, weights, errors."""
from __future__ import annotations

import pytest
import torch

from k3c.reference import KDAState, ReferenceModel, reference_forward
from k3c.frontend.weight_names import model_weights
from k3c.runtime.weights import init_weights
from refutil import rand_ids, record_sublayers, rel_err


def spec_of(request, name):
    return request.getfixturevalue(f"{name}_spec")


@pytest.mark.parametrize("name", ["tiny", "plain"])
@pytest.mark.parametrize("chunk", [64, 8])
def test_prefill_then_decodes_equals_longer_prefill(request, name, chunk):
    spec = spec_of(request, name)
    model = ReferenceModel(spec, init_weights(spec, seed=1), chunk_size=chunk)
    ids = rand_ids(2, 23, spec.vocab_size, seed=2)
    full, full_cache = model.prefill(ids)
    logits, cache = model.prefill(ids[:, :19])
    assert rel_err(logits, full[:, :19]) <= 1e-5
    for t in range(19, 23):
        step, cache = model.decode(ids[:, t], cache)
        assert step.shape == (2, spec.vocab_size)
        assert rel_err(step, full[:, t]) <= 1e-5, t
    assert cache.length == full_cache.length == 23
    for c, cf in zip(cache.layers, full_cache.layers):
        if isinstance(c, KDAState):
            assert rel_err(c.state, cf.state) <= 1e-5
        else:
            assert c.shape == cf.shape == (2, 23, spec.mla.cache_width) and rel_err(c, cf) <= 1e-5


@pytest.mark.parametrize("name", ["tiny", "plain"])
def test_append_prefill_equals_one_prefill(request, name):
    spec = spec_of(request, name)
    model = ReferenceModel(spec, init_weights(spec, seed=3), chunk_size=8)
    ids = rand_ids(1, 30, spec.vocab_size, seed=4)
    full, _ = model.prefill(ids)
    first, cache = model.prefill(ids[:, :13])
    second, cache2 = model.forward(ids[:, 13:], cache)
    assert rel_err(torch.cat([first, second], 1), full) <= 1e-5
    # the cache is not modified in place: the same prefix continues again, identically
    again, _ = model.forward(ids[:, 13:], cache)
    assert torch.equal(again, second) and cache.length == 13 and cache2.length == 30


@pytest.mark.parametrize("name", ["tiny", "plain"])
def test_forms_agree(request, name):
    spec = spec_of(request, name)
    w = init_weights(spec, seed=5)
    ids = rand_ids(2, 12, spec.vocab_size, seed=6)
    base = reference_forward(spec, w, ids)
    assert base.shape == (2, 12, spec.vocab_size) and torch.isfinite(base).all()
    assert rel_err(reference_forward(spec, w, ids, kda_mode="recurrent"), base) <= 1e-5
    assert rel_err(reference_forward(spec, w, ids, chunk_size=5), base) <= 1e-5
    assert rel_err(reference_forward(spec, w, ids, mla_mode="mqa"), base) <= 1e-5
    # the fp32 reference against its float64 self (the "fp32" parts in float64 too)
    assert rel_err(base, reference_forward(spec, w, ids, dtype=torch.float64)) <= 5e-5


def test_bf16_sublayers_close_to_fp32(tiny_spec):
    # Per sublayer, teacher-forced (the bf16 sublayer gets the fp32 run's input, rounded): end to end, this random
    # 8-layer model amplifies bf16 rounding to ~10% (and MoE routing flips to more), which would test nothing.
    w = init_weights(tiny_spec, seed=7)
    ids = rand_ids(2, 10, tiny_spec.vocab_size, seed=8)
    m32, m16 = ReferenceModel(tiny_spec, w), ReferenceModel(tiny_spec, w, dtype=torch.bfloat16)
    assert m16.w["layers.0.self_attn.A_log"].dtype == torch.float32             # "fp32" weights stay fp32
    rec = record_sublayers(m32)
    m32.prefill(ids)
    caches = m16.empty_cache().layers
    for j, (x, y) in enumerate(rec):
        i = j // 2
        if j % 2 == 0:
            y16, c = m16.attention(i, x.bfloat16(), caches[i])
            if isinstance(c, KDAState):
                assert c.state.dtype == torch.float32 and c.conv[0].dtype == torch.bfloat16
        else:
            y16 = m16.feed_forward(i, x.bfloat16())
        assert y16.dtype == torch.bfloat16
        per_token = (y16.float() - y).norm(dim=-1) / y.norm(dim=-1)
        # MoE: a routing flip changes a token completely; allow those few, bound the typical token
        assert per_token.median() < 2e-2, (j, per_token.median().item())
        if not tiny_spec.is_moe_layer(i) or j % 2 == 0:
            assert per_token.max() < 5e-2, (j, per_token.max().item())
    logits, cache = m16.prefill(ids)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    step, _ = m16.decode(ids[:, 0], cache)
    assert torch.isfinite(step.float()).all()


def test_tied_embeddings(tiny_spec):
    tied = tiny_spec.replace(tie_word_embeddings=True)
    w = init_weights(tied, seed=9)
    assert "lm_head.weight" not in w
    ids = rand_ids(1, 6, tied.vocab_size, seed=10)
    untied_w = dict(w, **{"lm_head.weight": w["embed_tokens.weight"].clone()})
    assert torch.equal(reference_forward(tied, w, ids), reference_forward(tiny_spec, untied_w, ids))
    untied_w["lm_head.weight"] = init_weights(tiny_spec, seed=9)["lm_head.weight"]
    assert rel_err(reference_forward(tiny_spec, untied_w, ids), reference_forward(tied, w, ids)) > 0.1


def test_residual_path_without_attnres(plain_spec):
    # attn_res None: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.)), written out here
    w = init_weights(plain_spec, seed=11)
    model = ReferenceModel(plain_spec, w)
    ids = rand_ids(1, 5, plain_spec.vocab_size, seed=12)
    x = model.embed(ids)
    for i in range(plain_spec.num_layers):
        x = x + model.attention(i, x, None)[0]
        x = x + model.feed_forward(i, x)
    assert rel_err(model.prefill(ids)[0], model.head(x)) <= 1e-6
    # and AttnRes weights are absent from the plain spec, present in K3's
    assert not any("_res." in n for n in w)


def test_init_weights_contract(tiny_spec, plain_spec):
    for spec in (tiny_spec, plain_spec):
        infos = model_weights(spec)
        w = init_weights(spec, seed=0, dtype=torch.bfloat16)
        assert list(w) == [i.name for i in infos]
        for i in infos:
            t = w[i.name]
            assert tuple(t.shape) == i.shape, i.name
            assert t.dtype == (torch.float32 if i.dtype == "fp32" else torch.bfloat16), i.name
            assert torch.isfinite(t.float()).all() and t.float().std() > 0 if t.numel() > 1 else True, i.name
    a, b = init_weights(tiny_spec, seed=0), init_weights(tiny_spec, seed=0)
    c = init_weights(tiny_spec, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a)
    # non-degenerate where degenerate would hide bugs
    assert all(a[k].abs().min() > 0 for k in a if k.endswith("proj_weight"))
    assert a["layers.1.block_sparse_moe.gate.e_score_correction_bias"].abs().min() > 0


@pytest.mark.parametrize("name", ["tiny", "plain"])
def test_init_decays_span_weak_to_strong(request, name):
    # per-token decays exp(g) on real layer inputs: some channels forget fast, some keep nearly everything
    from k3c.reference import kda_gate, linear, rms_norm, strip_prefix
    spec = spec_of(request, name)
    w = init_weights(spec, seed=0)
    lw = strip_prefix(w, "layers.0.self_attn.")
    x = rms_norm(w["embed_tokens.weight"][:64], None, 1e-5)
    g = kda_gate(linear(linear(x, lw["f_a_proj.weight"]), lw["f_b_proj.weight"]), lw["A_log"], lw["dt_bias"],
                 spec.kda)
    decay = g.exp()
    assert (decay < 0.3).float().mean() > 0.02 and (decay > 0.95).float().mean() > 0.1


def test_bad_inputs(tiny_spec):
    w = init_weights(tiny_spec, seed=0)
    with pytest.raises(KeyError, match="missing"):
        ReferenceModel(tiny_spec, {k: v for k, v in w.items() if k != "norm.weight"})
    bad = dict(w, **{"norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="norm.weight"):
        ReferenceModel(tiny_spec, bad)
    model = ReferenceModel(tiny_spec, w)
    _, cache = model.prefill(rand_ids(2, 4, tiny_spec.vocab_size, seed=0))
    with pytest.raises(ValueError, match="batch"):
        model.forward(rand_ids(3, 1, tiny_spec.vocab_size, seed=0), cache)
