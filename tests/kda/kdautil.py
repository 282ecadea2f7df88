"""Helpers of the KDA kernel tests (a uniquely named module)."""
from __future__ import annotations

import math

import torch

from k3c.frontend.spec import KDASpec
from k3c.reference import kda_gate, l2_norm


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, seed, scale=1.0):
    return scale * torch.randn(*shape, generator=gen(seed))


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def scan_inputs(n_tokens, h, d, gate, seed, lb=-5.0, f_scale=1.0, n_seq=1):
    """Token-major KDA scan inputs: q, k (unit norm), v, g, beta [total, H, (D)], initial state [n_seq, H, D, D]."""
    cfg = KDASpec(num_heads=h, head_dim=d, gate=gate, gate_lower_bound=lb)
    q = l2_norm(rnd(n_tokens, h, d, seed=seed))
    k = l2_norm(rnd(n_tokens, h, d, seed=seed + 1))
    v = rnd(n_tokens, h, d, seed=seed + 2)
    a_log = torch.linspace(math.log(0.5), math.log(8.0), h)
    dt_bias = rnd(h * d, seed=seed + 3) - (4.0 if gate == "softplus" else 1.0)
    g = kda_gate(rnd(n_tokens, h * d, seed=seed + 4, scale=f_scale), a_log, dt_bias, cfg)
    beta = torch.sigmoid(rnd(n_tokens, h, seed=seed + 5))
    s0 = rnd(n_seq, h, d, d, seed=seed + 6, scale=0.5)
    return q, k, v, g, beta, s0
