"""(Latent)MoE: routing, renormalisation, scaling and expert math against a per-token loop; GLU activations."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from k3c.frontend.spec import ActivationSpec
from k3c.reference import glu_act, mlp, moe_layer, route, strip_prefix
from k3c.runtime.weights import init_weights
from refutil import randn, rel_err


def dumb_moe(x, w, cfg, act, eps):
    """One token at a time, one expert at a time, in float64, straight from K3.md section 5."""
    x = x.double()
    W = {k: v.double() for k, v in w.items()}

    def a(g, u):
        if act.kind == "swiglu":
            return g * torch.sigmoid(g) * u
        bg, bu = act.situ_beta_gate, act.situ_beta_up
        return bg * torch.tanh(g / bg) * torch.sigmoid(g) * bu * torch.tanh(u / bu)

    out = []
    for tok in x.reshape(-1, x.shape[-1]):
        logits = [W["gate.weight"][e] @ tok for e in range(cfg.num_experts)]
        if cfg.router_activation == "sigmoid":
            s = [1 / (1 + math.exp(-v.item())) for v in logits]
        else:
            z = [math.exp(v.item()) for v in logits]
            s = [v / sum(z) for v in z]
        bias = W["gate.e_score_correction_bias"].tolist() if cfg.router_bias else [0.0] * cfg.num_experts
        chosen = sorted(range(cfg.num_experts), key=lambda e: s[e] + bias[e], reverse=True)[:cfg.top_k]
        total = sum(s[e] for e in chosen)
        p = {e: (s[e] / total if cfg.renormalize else s[e]) * cfg.routed_scaling_factor for e in chosen}
        zt = W["routed_expert_down_proj.weight"] @ tok if cfg.latent_dim else tok
        u = sum(p[e] * (W["experts.w2"][e] @ a(W["experts.w1"][e] @ zt, W["experts.w3"][e] @ zt)) for e in chosen)
        if cfg.latent_dim:
            if cfg.latent_norm:
                u = u / torch.sqrt((u * u).mean() + eps) * W["routed_expert_norm.weight"]
            u = W["routed_expert_up_proj.weight"] @ u
        if cfg.num_shared_experts:
            sg, su = W["shared_experts.gate_proj.weight"] @ tok, W["shared_experts.up_proj.weight"] @ tok
            u = u + W["shared_experts.down_proj.weight"] @ a(sg, su)
        out.append(u)
    return torch.stack(out).reshape(x.shape)


CASES = {
    "k3": {},
    "softmax-no-renorm-no-bias-swiglu": dict(router_activation="softmax", renormalize=False, router_bias=False,
                                             routed_scaling_factor=2.446, latent_dim=None, latent_norm=False),
    "latent-no-norm-scaled": dict(latent_norm=False, routed_scaling_factor=0.5, num_shared_experts=0),
    "sigmoid-no-renorm": dict(renormalize=False, top_k=3, shared_intermediate_size=48),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_per_token_loop(tiny_spec, case):
    moe = dataclasses.replace(tiny_spec.mlp.moe, **CASES[case])
    act = tiny_spec.mlp.activation if "swiglu" not in case else ActivationSpec("swiglu")
    spec = tiny_spec.replace(mlp=dataclasses.replace(tiny_spec.mlp, moe=moe, activation=act))
    w = strip_prefix(init_weights(spec, seed=3), "layers.1.block_sparse_moe.")
    x = randn(3, 7, spec.hidden_size, seed=4)
    got = moe_layer(x, w, moe, act, spec.rms_norm_eps)
    assert got.shape == x.shape
    assert rel_err(got, dumb_moe(x, w, moe, act, spec.rms_norm_eps)) <= 1e-5


def test_router_bias_selects_but_does_not_weigh(tiny_spec):
    cfg = tiny_spec.mlp.moe
    w = strip_prefix(init_weights(tiny_spec, seed=5), "layers.1.block_sparse_moe.")
    x = randn(20, tiny_spec.hidden_size, seed=6)
    bias = torch.zeros(cfg.num_experts)
    bias[5] = 10.0                                            # expert 5 wins every selection through the bias alone
    p, idx, scores = route(x, dict(w, **{"gate.e_score_correction_bias": bias}), cfg)
    assert (idx == 5).any(-1).all()
    top = scores.gather(-1, idx)
    assert torch.allclose(p, top / top.sum(-1, keepdim=True) * cfg.routed_scaling_factor)   # no bias in weights
    assert torch.allclose(p.sum(-1), torch.full((20,), cfg.routed_scaling_factor))
    # and without the boost, the init's bias changes some selections compared with no bias at all
    _, idx_b, _ = route(x, w, cfg)
    _, idx_nb, _ = route(x, w, dataclasses.replace(cfg, router_bias=False))
    assert (idx_b.sort(-1).values != idx_nb.sort(-1).values).any()


def test_situ_glu_formula():
    act = ActivationSpec("situ", situ_beta_gate=4.0, situ_beta_up=25.0)
    pts = [(1.3, -30.0), (-2.0, 0.7), (0.0, 5.0), (9.0, 100.0), (-50.0, 3.0)]
    g = torch.tensor([p[0] for p in pts])
    u = torch.tensor([p[1] for p in pts])
    got = glu_act(g, u, act)
    for (gv, uv), y in zip(pts, got.tolist()):
        want = (4 * math.tanh(gv / 4) / (1 + math.exp(-gv))) * (25 * math.tanh(uv / 25))
        assert y == pytest.approx(want, rel=1e-6, abs=1e-7)
    # bounded: |act| < b_g * b_u whatever the inputs (SwiGLU is not)
    big = torch.tensor([1e4]), torch.tensor([1e4])
    assert glu_act(*big, act).item() == pytest.approx(100.0, rel=1e-6)
    swi = glu_act(*big, ActivationSpec("swiglu")).item()
    assert swi == pytest.approx(1e8, rel=1e-6)
    g2, u2 = randn(50, seed=1, scale=3), randn(50, seed=2, scale=3)
    assert torch.allclose(glu_act(g2, u2, ActivationSpec("swiglu")), F.silu(g2) * u2)


def test_dense_mlp(tiny_spec):
    w = strip_prefix(init_weights(tiny_spec, seed=1), "layers.0.mlp.")
    x = randn(2, 3, tiny_spec.hidden_size, seed=2)
    act = tiny_spec.mlp.activation
    want = glu_act(x @ w["gate_proj.weight"].T, x @ w["up_proj.weight"].T, act) @ w["down_proj.weight"].T
    assert w["gate_proj.weight"].shape[0] == tiny_spec.mlp.dense_intermediate_size
    assert rel_err(mlp(x, w, act), want) <= 1e-6
