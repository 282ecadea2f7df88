"""Normalisations and small shared helpers of the reference semantics."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The two low-rank RMSNorms of MLA (q_a_layernorm, kv_a_layernorm) and the KDA q/k L2 norm use 1e-6 in the public
# implementations; every other RMSNorm uses spec.rms_norm_eps (K3.md sections 2 and 3).
LOW_RANK_NORM_EPS = 1e-6
L2_NORM_EPS = 1e-6


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of the "fp32" parts (state, scores, norms): fp32, or float64 when the model runs in float64
    (a float64 run is the reference's own oracle: it shows how far the fp32 reference is from exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def acc(x: torch.Tensor) -> torch.Tensor:
    """x in acc_dtype(x.dtype)."""
    return x.to(acc_dtype(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32, returned in x's dtype."""
    xf = acc(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * acc(weight)
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the sqrt, as fla and K3.md say), in fp32."""
    xf = acc(x)
    return xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x W^T in x's dtype (weights are [out, in] as in torch.nn.Linear)."""
    return F.linear(x, weight.to(x.dtype))
