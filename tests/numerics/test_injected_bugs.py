"""The power of the trained-model numerics checks (test_trained_agreement.py): each test injects one deliberate bug
into a compiled path, the reference keeping the true model, and asserts that the check that catches it fails with
the same bounds (trained_checks.py). Measured on examples/k3-stdlib (CPU), beside each test."""
from __future__ import annotations

import torch

import k3c.quant.mx as mx
from k3c.reference.kda import KDAState
from k3c.runtime import executor, kernel_impls
from numerics import rel
from trained_checks import (LOGITS_BOUNDS, NEW_TOKENS, PPL_BOUNDS, agreements, checkpoint, describe, needs_example,
                            ppl_change, trained, window_logits)

pytestmark = needs_example


# ---- (a) an off-by-one in the KDA conv tail kept between segments ----------------------------------------------
def conv_tail_one_token_late(impl, calls: list):
    """`impl` of the kda_attn op, keeping as each conv tail the kernel-1 pre-conv inputs ending one token before the
    segment's last (the newest dropped, one older kept): an off-by-one in the tail's slice."""
    def kda_attn_tail_off_by_one(a, cache, data, w):
        before = cache.layers[a["layer"]]
        out = impl(a, cache, data, w)
        after = cache.layers[a["layer"]]
        tails = []
        for j, (x, tail) in enumerate(zip(data[:3], after.conv)):         # x: q / k / v projections [B, T, C]
            old = before.conv[j] if before is not None else torch.zeros_like(tail)
            seen = torch.cat([old.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, kernel-1 + T]
            end = seen.shape[-1] - 1
            tails.append(seen[..., end - tail.shape[-1]:end].to(tail.dtype))
        cache.layers[a["layer"]] = KDAState(after.state, tuple(tails))
        calls.append(a["layer"])
        return out
    return kda_attn_tail_off_by_one


def test_conv_tail_off_by_one_fails_greedy_agreement(monkeypatch, heldout, reference):
    """Measured: every prompt fails, the first differing token (step 1-3) outside the other side's top-5; held-out
    scoring of fresh windows never carries a tail, prefix-resume's resumed halves do: perplexity +0.88% (bound
    0.25%; clean +0.08%)."""
    calls: list = []
    for table in (executor.TORCH_IMPLS, kernel_impls.KERNEL_IMPLS):      # the torch ops and the kernels alike
        monkeypatch.setitem(table, "kda_attn", conv_tail_one_token_late(table["kda_attn"], calls))
    ags = agreements(reference.generations, trained.greedy("compiled-bf16", heldout.prompts, NEW_TOKENS,
                                                           kernels=False))
    assert calls, "the compiled path never ran the patched kda_attn"
    assert not all(a.ok for a in ags), describe(ags)
    change = ppl_change(trained.heldout_nll("prefix-resume", heldout.windows, kernels=False), reference.nll)
    assert abs(change) > PPL_BOUNDS["prefix-resume"], change


# ---- (b) two MLA heads swapped in one layer --------------------------------------------------------------------
def heads_swapped(weights: dict, spec, layer: int) -> dict:
    """The weights with heads 0 and 1 of MLA layer `layer` exchanged in q_b_proj (each head a block of
    qk_nope + qk_rope rows), nothing else: head 0 attends with head 1's queries and the other way round."""
    name = f"layers.{layer}.self_attn.q_b_proj.weight"
    rows = spec.mla.qk_nope_head_dim + spec.mla.qk_rope_head_dim
    t = weights[name].clone()
    t[:rows], t[rows:2 * rows] = weights[name][rows:2 * rows], weights[name][:rows]
    return {**weights, name: t}


def test_swapped_mla_heads_fail_the_perplexity_bound(heldout, reference):
    """Measured: greedy agreement does not catch it (one prompt differs at its first token, within the top-5); the
    perplexity does: +2.24% against a bf16 bound of 0.25% (clean +0.08%)."""
    spec, weights = checkpoint()
    layer = spec.layer_kinds.index("mla")
    swapped = heads_swapped(weights, spec, layer)
    change = ppl_change(trained.heldout_nll("compiled-bf16", heldout.windows, kernels=False, weights=swapped),
                        reference.nll)
    assert abs(change) > PPL_BOUNDS["compiled-bf16"], change


# ---- (c) MXFP4 scales rounded up -------------------------------------------------------------------------------
def scales_rounded_up(scale_and_scaled):
    """k3c.quant.mx's block scale computation with the floor rule's E8M0 exponent floor(log2 amax) - emax rounded
    up instead: ceil(log2 amax) - emax, one more wherever amax is not a power of two (the elements halve)."""
    def rounded_up(xb, rule, elem_max, elem_emax):
        scale, scaled, isnan = scale_and_scaled(xb, rule, elem_max, elem_emax)
        amax = xb.abs().amax(dim=-1).to(torch.float32)
        up = ((amax.view(torch.int32) & 0x7FFFFF) != 0) & ~isnan.squeeze(-1) & (scale < 254)
        return scale + up.to(torch.uint8), torch.where(up[..., None], scaled / 2, scaled), isnan
    return rounded_up


def test_mxfp4_scales_rounded_up_fail_the_logits_bound(monkeypatch, heldout, mxfp4_oracle_logits):
    """Measured: neither greedy agreement (every prompt acceptable) nor the perplexity (+1.72%; clean +1.35%, bound
    3%) catches it. The logits against the spec rule's oracle do: rel L2 7.6e-2, bound 2.5e-2 (clean 1.1e-2)."""
    _, weights = checkpoint()
    w1 = weights["layers.1.block_sparse_moe.experts.w1"]
    before = mx.mxfp4_quantize(w1, "floor")[1]
    monkeypatch.setattr(mx, "_scale_and_scaled", scales_rounded_up(mx._scale_and_scaled))
    assert (mx.mxfp4_quantize(w1, "floor")[1] != before).float().mean() > 0.9      # the rule really changed
    err = rel(window_logits("mxfp4", heldout.windows, kernels=False), mxfp4_oracle_logits)
    assert err > LOGITS_BOUNDS[("mxfp4", "mxfp4 oracle")], err
