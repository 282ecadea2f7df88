"""Block AttnRes: the K3 decoder loop against a naive explicit-source implementation, the mix, the two-phase form."""
from __future__ import annotations

import pytest
import torch

from k3c.frontend.spec import AttnResSpec
from k3c.reference import (ReferenceModel, attn_res_merge, attn_res_mix, attn_res_partial,
                                   attn_res_query)
from k3c.runtime.weights import init_weights
from refutil import rand_ids, randn, record_sublayers, rel_err


def naive_mix(sources, proj_weight, norm_weight, eps):
    """alpha_i = softmax_i(w . RMSNorm(v_i)) with the gain inside the norm; h = sum alpha_i v_i (float64)."""
    vs = [v.double() for v in sources]
    normed = [v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * norm_weight.double() for v in vs]
    a = torch.softmax(torch.stack([(n * proj_weight.double()).sum(-1) for n in normed], -1), -1)
    return sum(a[..., i, None] * v for i, v in enumerate(vs)).to(sources[0].dtype)


def naive_attnres_logits(model: ReferenceModel, ids: torch.Tensor) -> torch.Tensor:
    """Every sublayer attends to an explicit list: b_0 = embedding, every completed block's sum of sublayer outputs
    (2 * block_size sublayers per block), then the sum of the sublayers already run in its own block."""
    spec, w = model.spec, model.w
    per_block = 2 * spec.attn_res.block_size
    eps = spec.rms_norm_eps
    emb = model.embed(ids)
    outs: list[torch.Tensor] = []

    def sources(j):
        first = (j // per_block) * per_block                        # first sublayer of j's block
        blocks = [sum(outs[s:s + per_block]) for s in range(0, first, per_block)]
        return [emb, *blocks] + ([sum(outs[first:j])] if j > first else [])

    def mix(j, prefix):
        return naive_mix(sources(j), w[f"{prefix}.proj_weight"], w[f"{prefix}.norm_weight"], eps)

    for i in range(spec.num_layers):
        outs.append(model.attention(i, mix(2 * i, f"layers.{i}.self_attention_res"), None)[0])
        outs.append(model.feed_forward(i, mix(2 * i + 1, f"layers.{i}.mlp_res")))
    n = len(outs)
    final = [emb] + [sum(outs[s:s + per_block]) for s in range(0, n, per_block)]   # the last block may be partial
    out = naive_mix(final, w["output_attn_res.proj_weight"], w["output_attn_res.norm_weight"], eps)
    return model.head(out)


@pytest.mark.parametrize("block_size", [1, 3, 8, 100])
def test_decoder_loop_matches_naive(tiny_spec, block_size):
    spec = tiny_spec.replace(attn_res=AttnResSpec(block_size))
    w = init_weights(spec, seed=block_size)
    ids = rand_ids(2, 9, spec.vocab_size, seed=block_size)
    # float64 (the "fp32" parts too): the two orderings agree to rounding, any wiring slip is O(1)
    m64 = ReferenceModel(spec, w, dtype=torch.float64)
    assert rel_err(m64.prefill(ids)[0], naive_attnres_logits(m64, ids)) <= 1e-10
    # fp32, end to end. At block size 1 the 8-layer random model amplifies rounding: a 1e-7 relative weight
    # perturbation moves its logits by 3e-5..9e-5 (block size 3: ~5e-6, 1.2e-5 where the CPU's fp32 reductions
    # run in AVX-512 order), so 1e-5 is out of reach there.
    model = ReferenceModel(spec, w)
    got = model.prefill(ids)[0]
    assert rel_err(got, naive_attnres_logits(model, ids)) <= (1e-4 if block_size == 1 else 2e-5)


@pytest.mark.parametrize("block_size", [1, 3, 8, 100])
def test_sublayer_inputs_match_naive_sources(tiny_spec, block_size):
    # fp32, teacher-forced: every sublayer input the loop produced == the naive mix over explicit sources built
    # from the loop's own sublayer outputs (no amplification through later layers, so a tight bound)
    spec = tiny_spec.replace(attn_res=AttnResSpec(block_size))
    model = ReferenceModel(spec, init_weights(spec, seed=7))
    rec = record_sublayers(model)
    ids = rand_ids(2, 9, spec.vocab_size, seed=8)
    logits = model.prefill(ids)[0]
    per_block, emb, eps = 2 * block_size, model.embed(ids), spec.rms_norm_eps
    outs = [y for _, y in rec]
    assert len(rec) == 2 * spec.num_layers
    for j, (h, _) in enumerate(rec):
        first = (j // per_block) * per_block
        srcs = [emb] + [sum(outs[s:s + per_block]) for s in range(0, first, per_block)]
        srcs += [sum(outs[first:j])] if j > first else []
        prefix = f"layers.{j // 2}.{'self_attention_res' if j % 2 == 0 else 'mlp_res'}"
        want = naive_mix(srcs, model.w[f"{prefix}.proj_weight"], model.w[f"{prefix}.norm_weight"], eps)
        assert rel_err(h, want) <= 1e-6, (j, len(srcs))
    final = [emb] + [sum(outs[s:s + per_block]) for s in range(0, len(outs), per_block)]
    out = naive_mix(final, model.w["output_attn_res.proj_weight"], model.w["output_attn_res.norm_weight"], eps)
    assert rel_err(logits, model.head(out)) <= 1e-6


def test_block_size_changes_the_model(tiny_spec):
    # the grouping really matters: different block sizes give different logits from the same weights
    w = init_weights(tiny_spec, seed=0)
    ids = rand_ids(1, 7, tiny_spec.vocab_size, seed=1)
    outs = [ReferenceModel(tiny_spec.replace(attn_res=AttnResSpec(s)), w).prefill(ids)[0] for s in (1, 3, 100)]
    assert rel_err(outs[0], outs[1]) > 1e-2 and rel_err(outs[1], outs[2]) > 1e-2


def test_mix_matches_naive_and_two_phase():
    d, eps = 32, 1e-5
    srcs = [randn(3, 5, d, seed=i, scale=1 + i) for i in range(5)]
    pw, nw = randn(d, seed=10, scale=0.5), 1 + 0.1 * randn(d, seed=11)
    h = attn_res_mix(srcs, pw, nw, eps)
    assert rel_err(h, naive_mix(srcs, pw, nw, eps)) <= 1e-6
    # phase 1 over completed blocks, phase 2 the newest source alone, merged by online softmax
    q = attn_res_query(pw, nw)
    merged = attn_res_merge([attn_res_partial(srcs[:3], q, eps), attn_res_partial(srcs[3:4], q, eps),
                             attn_res_partial(srcs[4:], q, eps)])
    assert rel_err(merged, h) <= 1e-6
    # sanity of the degenerate cases the random init avoids: one source is the identity, a zero query averages
    assert torch.equal(attn_res_mix(srcs[:1], pw, nw, eps), srcs[0])
    assert rel_err(attn_res_mix(srcs, torch.zeros(d), nw, eps), sum(srcs) / len(srcs)) <= 1e-6


def test_mix_keeps_dtype_and_scores_in_fp32():
    d = 16
    srcs = [randn(2, d, seed=i).to(torch.bfloat16) for i in range(3)]
    pw, nw = randn(d, seed=5).to(torch.bfloat16), torch.ones(d, dtype=torch.bfloat16)
    h = attn_res_mix(srcs, pw, nw, 1e-5)
    assert h.dtype == torch.bfloat16
    assert rel_err(h, naive_mix([s.float() for s in srcs], pw.float(), nw.float(), 1e-5)) <= 1e-2
