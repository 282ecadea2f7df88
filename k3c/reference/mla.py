"""Gated NoPE Multi-head Latent Attention (K3.md section 3) with a latent cache.

The cache holds, per token, [c (L) | k_pe (R)] where c is already RMS-normed: what every engine caches (576 values
at K3 shapes). Nothing is rotated (NoPE), so cached keys never depend on position and append/decode are exact.
Two equivalent attention forms: "mha" (expand k_nope, v per head for every cached token; the prefill form and the
semantics) and "mqa" (absorbed: W_UK into the query, W_UV after the latent average; the decode form, kept here as
the oracle for the mla-absorb pass).
"""
from __future__ import annotations

from typing import Literal

import torch

from ..frontend.spec import MLASpec
from .norms import LOW_RANK_NORM_EPS, acc, linear, rms_norm

MLAMode = Literal["mha", "mqa"]


def mla_query(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: MLASpec) -> torch.Tensor:
    """q [B, T, N, P+R] = [q_nope | q_pe] per head."""
    if cfg.q_lora_rank is None:
        q = linear(x, w["q_proj.weight"])
    else:
        c_q = rms_norm(linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], LOW_RANK_NORM_EPS)
        q = linear(c_q, w["q_b_proj.weight"])
    return q.unflatten(-1, (cfg.num_heads, cfg.qk_head_dim))


def mla_latent(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: MLASpec) -> torch.Tensor:
    """The cache entries of x: [B, T, L+R] = [RMSNorm(c) | k_pe]."""
    kv = linear(x, w["kv_a_proj_with_mqa.weight"])
    c, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    return torch.cat([rms_norm(c, w["kv_a_layernorm.weight"], LOW_RANK_NORM_EPS), k_pe], dim=-1)


def _causal_mask(t_q: int, t_k: int, device) -> torch.Tensor:
    """[t_q, t_k] True where allowed: the queries are the last t_q of the t_k positions."""
    qpos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    return torch.arange(t_k, device=device)[None, :] <= qpos


def mla_attention(q: torch.Tensor, latent: torch.Tensor, w: dict[str, torch.Tensor], cfg: MLASpec,
                  mode: MLAMode = "mha") -> torch.Tensor:
    """Causal attention of q [B, Tq, N, P+R] (the last Tq positions) over latent [B, Tk, L+R] (every position,
    the new ones included). Scores, softmax and the value average run in fp32. Returns o [B, Tq, N, V] in q's dtype."""
    n, p, r, dv, lat = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    scale = (p + r) ** -0.5
    qf, lf = acc(q), acc(latent)
    q_nope, q_pe = qf.split([p, r], dim=-1)
    c, k_pe = lf.split([lat, r], dim=-1)
    w_kvb = acc(w["kv_b_proj.weight"]).view(n, p + dv, lat)              # per head [k_nope rows | v rows]
    w_uk, w_uv = w_kvb[:, :p], w_kvb[:, p:]                                  # [N, P, L], [N, V, L]
    mask = _causal_mask(q.shape[1], latent.shape[1], q.device)
    # the rope part is shared by all heads and never rotated
    pe_scores = torch.einsum("bqnr,bkr->bnqk", q_pe, k_pe)
    if mode == "mha":
        k_nope = torch.einsum("bkl,npl->bknp", c, w_uk)
        v = torch.einsum("bkl,nvl->bknv", c, w_uv)
        scores = torch.einsum("bqnp,bknp->bnqk", q_nope, k_nope) + pe_scores
        probs = torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1)
        o = torch.einsum("bnqk,bknv->bqnv", probs, v)
    elif mode == "mqa":
        q_lat = torch.einsum("bqnp,npl->bqnl", q_nope, w_uk)                # absorb W_UK into the query
        scores = torch.einsum("bqnl,bkl->bnqk", q_lat, c) + pe_scores
        probs = torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1)
        o_lat = torch.einsum("bnqk,bkl->bqnl", probs, c)
        o = torch.einsum("bqnl,nvl->bqnv", o_lat, w_uv)                      # W_UV after the average
    else:
        raise ValueError(f"unknown MLA mode {mode!r} (mha | mqa)")
    return o.to(q.dtype)


def mla_layer(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: MLASpec, cache: torch.Tensor | None = None,
              *, mode: MLAMode = "mha") -> tuple[torch.Tensor, torch.Tensor]:
    """One MLA layer on x [B, T, hidden] (already normed) appended after `cache` [B, Tc, L+R] (None = empty).
    `w` holds the layer's weights without the `layers.{i}.self_attn.` prefix. Returns (y [B, T, hidden],
    new cache [B, Tc+T, L+R]); the input cache is not modified."""
    new = mla_latent(x, w, cfg)
    latent = new if cache is None else torch.cat([cache.to(new.dtype), new], dim=1)
    o = mla_attention(mla_query(x, w, cfg), latent, w, cfg, mode)
    if cfg.output_gate:
        # per head, before o_proj: this is why W_UV cannot be folded into o_proj for gated MLA
        gate = torch.sigmoid(acc(linear(x, w["g_proj.weight"]))).unflatten(-1, (cfg.num_heads, cfg.v_head_dim))
        o = (acc(o) * gate).to(x.dtype)
    return linear(o.flatten(-2), w["o_proj.weight"]), latent
