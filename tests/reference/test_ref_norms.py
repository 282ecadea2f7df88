"""Norms: where the epsilon sits (it only shows on small vectors) and the dtype contract."""
from __future__ import annotations

import math

import torch

from k3c.reference import l2_norm, rms_norm
from refutil import randn, rel_err


def test_l2_norm_eps_inside_sqrt():
    x = randn(5, 16, seed=1)
    x = x / x.norm(dim=-1, keepdim=True) * 1e-3                       # sum(x^2) = 1e-6 = eps
    assert rel_err(l2_norm(x), x / math.sqrt(2e-6)) <= 1e-6          # eps outside the sqrt would give x / 1.001e-3
    assert rel_err(l2_norm(x * 1e3), x * 1e3) <= 1e-6 and l2_norm(x).dtype == torch.float32


def test_rms_norm_eps_gain_and_dtype():
    x, gain = randn(4, 32, seed=2), 1 + 0.1 * randn(32, seed=3)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * math.sqrt(1e-5)  # mean(x^2) = eps
    assert rel_err(rms_norm(x, gain, 1e-5), x / math.sqrt(2e-5) * gain) <= 1e-6
    assert rel_err(rms_norm(x, None, 1e-5), x / math.sqrt(2e-5)) <= 1e-6
    xb = (x * 1e4).bfloat16()
    y = rms_norm(xb, gain.bfloat16(), 1e-5)
    assert y.dtype == torch.bfloat16
    want = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5) * gain.bfloat16().float()
    assert torch.equal(y, want.bfloat16())                            # fp32 inside, one rounding at the end
