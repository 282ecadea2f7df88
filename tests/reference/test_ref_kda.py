"""KDA: the recurrence against fla's naive_recurrent_kda, chunked == recurrent, gates, conv tails, segments."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from k3c.frontend.spec import KDASpec
from k3c.reference import (kda_chunked, kda_gate, kda_layer, kda_recurrent, l2_norm, short_conv,
                                   strip_prefix)
from k3c.runtime.weights import init_weights
from refutil import fla_naive, randn, rel_err


def make_inputs(b, t, h, d, gate, seed, lb=-5.0, f_scale=1.0):
    """Random KDA inputs with the gate computed by the reference (A_log, dt_bias in a realistic range)."""
    cfg = KDASpec(num_heads=h, head_dim=d, gate=gate, gate_lower_bound=lb)
    q = l2_norm(randn(b, t, h, d, seed=seed))
    k = l2_norm(randn(b, t, h, d, seed=seed + 1))
    v = randn(b, t, h, d, seed=seed + 2)
    a_log = torch.linspace(math.log(0.5), math.log(8.0), h)
    dt_bias = randn(h * d, seed=seed + 3) - (4.0 if gate == "softplus" else 1.0)
    g = kda_gate(randn(b, t, h * d, seed=seed + 4, scale=f_scale), a_log, dt_bias, cfg)
    beta = torch.sigmoid(randn(b, t, h, seed=seed + 5))
    s0 = randn(b, h, d, d, seed=seed + 6, scale=0.5)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("t", [1, 63, 65])
def test_recurrent_and_chunked_match_fla_naive(gate, d, t):
    naive = fla_naive().naive_recurrent_kda
    q, k, v, g, beta, s0 = make_inputs(2, t, 2, d, gate, seed=10 * d + t)
    o_ref, s_ref = naive(q, k, v, g, beta, initial_state=s0.clone(), output_final_state=True)
    assert torch.isfinite(o_ref).all() and o_ref.norm() > 0
    for fn in (kda_recurrent, kda_chunked):
        o, s = fn(q, k, v, g, beta, initial_state=s0)
        assert o.dtype == s.dtype == torch.float32
        assert rel_err(o, o_ref) <= 1e-5, fn.__name__
        assert rel_err(s, s_ref) <= 1e-5, fn.__name__


@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("t", [1, 63, 65, 130])
@pytest.mark.parametrize("chunk", [64, 16])
def test_chunked_equals_recurrent(gate, t, chunk):
    q, k, v, g, beta, s0 = make_inputs(2, t, 3, 32, gate, seed=t + chunk)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert rel_err(o_c, o_r) <= 1e-5
    assert rel_err(s_c, s_r) <= 1e-5
    # without an initial state too
    o_r, s_r = kda_recurrent(q, k, v, g, beta)
    o_c, s_c = kda_chunked(q, k, v, g, beta, chunk_size=chunk)
    assert rel_err(o_c, o_r) <= 1e-5 and rel_err(s_c, s_r) <= 1e-5


def test_extreme_gates_stay_finite():
    # f huge: the safe gate saturates at lb = -5 on every channel; a 64-token chunk spans log-decay -320, far past
    # fp32 exp range. Half the channels get the weakest decay instead so the state does not simply vanish.
    b, t, h, d = 1, 130, 2, 16
    q, k, v, g, beta, s0 = make_inputs(b, t, h, d, "safe", seed=3, f_scale=1e3)
    assert g.min() >= -5.0 and (g <= -4.999).float().mean() > 0.4
    g = g.clone()
    g[..., : d // 2] = -1e-4
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert rel_err(o_c, o_r) <= 1e-5 and rel_err(s_c, s_r) <= 1e-5
    # every channel at lb: still finite (the state decays to the last tokens' updates)
    g_all = torch.full_like(g, -5.0)
    o_c, s_c = kda_chunked(q, k, v, g_all, beta, initial_state=s0)
    o_r, _ = kda_recurrent(q, k, v, g_all, beta, initial_state=s0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all() and rel_err(o_c, o_r) <= 1e-5


def test_gate_formulas_and_layout():
    h, d = 3, 4
    f = randn(2, 5, h * d, seed=1)
    a_log, dt_bias = randn(h, seed=2), randn(h * d, seed=3)
    for gate in ("safe", "softplus"):
        cfg = KDASpec(num_heads=h, head_dim=d, gate=gate, gate_lower_bound=-5.0)
        g = kda_gate(f, a_log, dt_bias, cfg)
        assert g.shape == (2, 5, h, d) and g.dtype == torch.float32 and (g <= 0).all()
        for (bi, ti, hi, di) in [(0, 0, 0, 0), (1, 4, 2, 3), (0, 2, 1, 2)]:
            x = f[bi, ti, hi * d + di].item() + dt_bias[hi * d + di].item()       # dt_bias is flat [H*K]
            a = math.exp(a_log[hi].item())                                        # A_log is per head
            want = -a * math.log1p(math.exp(x)) if gate == "softplus" else -5.0 / (1 + math.exp(-a * x))
            assert g[bi, ti, hi, di].item() == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("kernel", [4, 2, 1])
def test_short_conv_against_padded_conv_and_tails(kernel):
    b, t, c = 2, 11, 6
    x, w = randn(b, t, c, seed=kernel), randn(c, 1, kernel, seed=kernel + 1)
    # direct definition: left-pad kernel-1 zeros, y_t = sum_j w[j] x_{t-kernel+1+j}
    xp = F.pad(x.transpose(1, 2), (kernel - 1, 0))
    want = F.silu(torch.stack([(xp[:, :, s:s + kernel] * w[:, 0]).sum(-1) for s in range(t)], dim=-1)).transpose(1, 2)
    y, tail = short_conv(x, w)
    assert rel_err(y, want) <= 1e-6
    assert tail.shape == (b, c, kernel - 1)
    # segmented, with segments shorter than the tail: exact continuation
    ys, tail_s = [], None
    for a, e in [(0, 1), (1, 2), (2, 7), (7, 11)]:
        yy, tail_s = short_conv(x[:, a:e], w, tail_s)
        ys.append(yy)
    assert rel_err(torch.cat(ys, 1), want) <= 1e-6
    assert torch.equal(tail_s, tail)
    if kernel > 1:
        assert torch.equal(tail, x[:, -(kernel - 1):].transpose(1, 2))


@pytest.mark.parametrize("variant", ["k3", "kimi-linear"])
def test_kda_layer_segments_and_modes(tiny_spec, plain_spec, variant):
    spec = tiny_spec if variant == "k3" else plain_spec
    w = strip_prefix(init_weights(spec, seed=4), "layers.0.self_attn.")
    x = randn(2, 40, spec.hidden_size, seed=5)
    eps = spec.rms_norm_eps
    y_full, st_full = kda_layer(x, w, spec.kda, eps, chunk_size=16)
    y_rec, st_rec = kda_layer(x, w, spec.kda, eps, mode="recurrent")
    assert rel_err(y_rec, y_full) <= 1e-5 and rel_err(st_rec.state, st_full.state) <= 1e-5
    ys, st = [], None
    for a, e in [(0, 17), (17, 18), (18, 19), (19, 21), (21, 40)]:        # prefill, decodes, a short and long append
        y, st = kda_layer(x[:, a:e], w, spec.kda, eps, st, chunk_size=16)
        ys.append(y)
    assert rel_err(torch.cat(ys, 1), y_full) <= 1e-5
    assert rel_err(st.state, st_full.state) <= 1e-5
    for tail, tail_full in zip(st.conv, st_full.conv):
        assert torch.equal(tail, tail_full)
    assert st_full.conv[0].shape == (2, spec.kda.width, spec.kda.conv_kernel - 1)


def test_kda_layer_uses_each_gate(tiny_spec):
    # switching the gate kind or the output-gate rank must change the output: both paths are really wired
    w_all = init_weights(tiny_spec, seed=1)
    w = strip_prefix(w_all, "layers.0.self_attn.")
    x = randn(1, 9, tiny_spec.hidden_size, seed=2)
    cfg = tiny_spec.kda
    y_safe, _ = kda_layer(x, w, cfg, 1e-5)
    y_soft, _ = kda_layer(x, w, dataclasses.replace(cfg, gate="softplus"), 1e-5)
    assert rel_err(y_soft, y_safe) > 1e-2
    w_lr = dict(w, **{"g_a_proj.weight": randn(cfg.head_dim, tiny_spec.hidden_size, seed=7, scale=0.125),
                      "g_b_proj.weight": randn(cfg.width, cfg.head_dim, seed=8, scale=0.25)})
    y_lr, _ = kda_layer(x, w_lr, dataclasses.replace(cfg, output_gate="low_rank"), 1e-5)
    assert rel_err(y_lr, y_safe) > 1e-2
