"""Quantile Balancing of router biases (K3.md §5; Su 2026), for calibrating `e_score_correction_bias` from
recorded router scores.

Routing: experts T = topk(s + b, k). Given the current bias b, per token t let alpha_t be the (k+1)-th largest of
s_t + b (the best score that was NOT routed). Expert j is chosen for token t about when s_tj - alpha_t > -b_j, so
setting -b_j to the (1 - k/n) quantile over tokens of (s_tj - alpha_t) gives every expert a k/n share of the tokens.
The new bias is mean-centred (only differences between biases change routing). Iterate to converge; freeze after.
"""
from __future__ import annotations

import torch

__all__ = ["expert_load", "load_imbalance", "quantile_balancing"]


def _check(scores: torch.Tensor, k: int, bias: torch.Tensor | None) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [tokens, experts], got shape {tuple(scores.shape)}")
    T, n = scores.shape
    if not (isinstance(k, int) and 1 <= k < n):
        raise ValueError(f"k must be an int with 1 <= k < n_experts = {n}, got {k!r}")
    if T == 0:
        raise ValueError("scores has no tokens")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")


def quantile_balancing(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One Quantile Balancing step: scores [T, n] (router scores s, e.g. sigmoid, before the bias), top-k, bias [n]
    (None = zeros) -> new bias [n] (fp32, mean zero). The quantile interpolates linearly (torch.quantile's default),
    computed by a sort, so any T works."""
    _check(scores, k, bias)
    s = scores.to(torch.float32)
    T, n = s.shape
    b = torch.zeros(n, dtype=torch.float32, device=s.device) if bias is None else bias.to(torch.float32)
    alpha = torch.topk(s + b, k + 1, dim=1).values[:, k : k + 1]  # (k+1)-th largest, with the OLD bias
    d, _ = torch.sort(s - alpha, dim=0)  # [T, n], each column ascending
    pos = (1.0 - k / n) * (T - 1)
    lo = int(pos)
    hi = min(lo + 1, T - 1)
    frac = pos - lo
    q = d[lo] + (d[hi] - d[lo]) * frac
    new_b = -q
    return new_b - new_b.mean()


def expert_load(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert by topk(scores + bias, k): int64 [n]."""
    _check(scores, k, bias)
    s = scores.to(torch.float32)
    if bias is not None:
        s = s + bias.to(torch.float32)
    idx = torch.topk(s, k, dim=1).indices
    return torch.bincount(idx.reshape(-1), minlength=s.shape[1])


def load_imbalance(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> float:
    """max / mean expert load under topk(scores + bias, k) (1.0 = perfectly balanced)."""
    load = expert_load(scores, k, bias).to(torch.float64)
    return float(load.max() / load.mean())
