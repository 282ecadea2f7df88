"""Block Attention Residuals (K3.md section 4): the depth-wise softmax mix over block representations.

AttnRes mixes along depth only, position by position: a token's sublayer inputs depend on that token's own block
representations and nothing else. So, across tokens, it needs no cache at all (decode recomputes the current
token's blocks inside its forward pass); the "blocks in the session cache" of the split schedule are per-step
scratch for the token(s) being processed.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .norms import acc


def attn_res_query(proj_weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """w * norm_gain folded into one fp32 query: w . RMSNorm(v) = (w * gain) . v / rms(v)."""
    return acc(proj_weight) * acc(norm_weight)


def attn_res_logits(sources: Sequence[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """Scores [..., n_sources] in fp32: (query . v_i) / rms(v_i), rms(v) = sqrt(mean(v^2) + eps)."""
    cols = []
    for v in sources:
        vf = acc(v)
        cols.append((vf @ query) * torch.rsqrt(vf.pow(2).mean(-1) + eps))
    return torch.stack(cols, dim=-1)


def attn_res_mix(sources: Sequence[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h = sum_i softmax_i(scores) v_i over sources [..., d] (completed blocks, then the partial sum).
    Scores and the weighted sum are fp32; the result is in the dtype of the last source."""
    if not sources:
        raise ValueError("attn_res_mix needs at least one source")
    if len(sources) == 1:
        return sources[0]                                                    # softmax over one source is 1
    a = torch.softmax(attn_res_logits(sources, attn_res_query(proj_weight, norm_weight), eps), dim=-1)
    h = sum(a[..., i, None] * acc(v) for i, v in enumerate(sources))
    return h.to(sources[-1].dtype)


# -- two-phase form (paper Alg. 1): the oracle for a split schedule ------------------------------------------------
def attn_res_partial(sources: Sequence[torch.Tensor], query: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised partial result over some sources: (o = sum e^(s_i - m) v_i / l, m = max s, l = sum e^(s_i - m)),
    o, m, l in fp32 with m, l [..., 1]."""
    s = attn_res_logits(sources, query, eps)
    m = s.amax(-1, keepdim=True)
    e = (s - m).exp()
    l = e.sum(-1, keepdim=True)
    o = sum(e[..., i, None] * acc(v) for i, v in enumerate(sources)) / l
    return o, m, l


def attn_res_merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Online-softmax merge of attn_res_partial results: h = sum e^(m_j - m) l_j o_j / sum e^(m_j - m) l_j (fp32)."""
    m = torch.stack([p[1] for p in parts]).amax(0)
    num = sum((p[1] - m).exp() * p[2] * p[0] for p in parts)
    den = sum((p[1] - m).exp() * p[2] for p in parts)
    return num / den
