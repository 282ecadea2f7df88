"""Feed-forward blocks (K3.md section 5): GLU activations, dense MLP, router and (Latent)MoE, on one rank or over
expert parallel ranks.

The router's discrete choice can be overridden: `choose_experts(ids [N, k]) -> ids` (routing replay, from the
runtime) gets the experts each router call picked and returns the ones it uses; the weights are always this call's
scores at the experts used.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..frontend.spec import ActivationSpec, MoESpec
from .norms import acc, acc_dtype, linear, rms_norm

ChooseExperts = Callable[[torch.Tensor], torch.Tensor]


def glu_act(g: torch.Tensor, u: torch.Tensor, act: ActivationSpec) -> torch.Tensor:
    """SwiGLU silu(g) * u, or SiTU-GLU [b_g tanh(g/b_g) sigmoid(g)] * [b_u tanh(u/b_u)]; fp32 inside."""
    gf, uf = acc(g), acc(u)
    if act.kind == "swiglu":
        y = F.silu(gf) * uf
    elif act.kind == "situ":
        bg, bu = act.situ_beta_gate, act.situ_beta_up
        y = (bg * torch.tanh(gf / bg) * torch.sigmoid(gf)) * (bu * torch.tanh(uf / bu))
    else:
        raise ValueError(f"unknown activation {act.kind!r}")
    return y.to(g.dtype)


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor], act: ActivationSpec) -> torch.Tensor:
    """down(act(gate x, up x)) with `gate_proj/up_proj/down_proj.weight` (dense layers and shared experts)."""
    return linear(glu_act(linear(x, w["gate_proj.weight"]), linear(x, w["up_proj.weight"]), act),
                  w["down_proj.weight"])


def routed_weights(scores: torch.Tensor, ids: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """fp32 weights [N, k] for experts `ids` from scores [N, E] (the bias never enters): the routers' own rule."""
    p = scores.float().gather(-1, ids.long())
    if renormalize:
        p = p / (p.sum(-1, keepdim=True) + 1e-20)
    return p * scaling


def route(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: MoESpec, choose_experts: ChooseExperts | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router over tokens x [N, d] at full width, fp32. Returns (weights [N, k] fp32, experts [N, k] int64,
    scores [N, E] fp32). The correction bias picks the experts but never enters the weights."""
    scores = linear(acc(x), acc(w["gate.weight"]))
    scores = torch.sigmoid(scores) if cfg.router_activation == "sigmoid" else torch.softmax(scores, dim=-1)
    choice = scores + acc(w["gate.e_score_correction_bias"]) if cfg.router_bias else scores
    idx = torch.topk(choice, cfg.top_k, dim=-1).indices
    if choose_experts is not None:
        idx = choose_experts(idx)
    return routed_weights(scores, idx, cfg.renormalize, cfg.routed_scaling_factor), idx, scores


def routed_experts(z: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, p: torch.Tensor,
                   idx: torch.Tensor, act: ActivationSpec) -> torch.Tensor:
    """u = sum_k p_k E_{idx_k}(z) for z [N, z_dim], stacked w1, w3 [E, m, z_dim], w2 [E, z_dim, m].
    Loops only over experts that received tokens; accumulates in fp32, returns z's dtype."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    u = torch.zeros(n, w2.shape[1], dtype=acc_dtype(z.dtype), device=z.device)
    start = 0
    for e, cnt in zip(experts.tolist(), counts.tolist()):
        slots = order[start:start + cnt]                                     # (token, k) pairs sent to expert e
        start += cnt
        tokens = slots // k
        zs = z[tokens]
        y = linear(glu_act(linear(zs, w1[e]), linear(zs, w3[e]), act), w2[e])
        u.index_add_(0, tokens, acc(y) * p.reshape(-1)[slots, None])
    return u.to(z.dtype)


def moe_layer(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: MoESpec, act: ActivationSpec, eps: float,
              choose_experts: ChooseExperts | None = None) -> torch.Tensor:
    """(Latent)MoE on x [..., d] (already normed). `w` holds the weights without `layers.{i}.block_sparse_moe.`;
    eps is spec.rms_norm_eps (routed_expert_norm)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    p, idx, _ = route(x2, w, cfg, choose_experts)
    z = linear(x2, w["routed_expert_down_proj.weight"]) if cfg.latent_dim is not None else x2
    u = routed_experts(z, w["experts.w1"], w["experts.w3"], w["experts.w2"], p, idx, act)
    return moe_output(u, x2, w, cfg, act, eps).reshape(shape)


def moe_layer_ep(x: torch.Tensor, w: dict, cfg: MoESpec, act: ActivationSpec, eps: float, ep_rank: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor], choose_experts: ChooseExperts | None = None
                 ) -> torch.Tensor:
    """(Latent)MoE with this rank's experts w["experts.*"][0:E/ep] = global [ep_rank E/ep, (ep_rank+1) E/ep).
    Routing runs over all E (router replicated), only local experts are computed; `reduce` sums the fp32 routed
    combine over the EP ranks (the caller's all-reduce), then the (nonlinear) latent RMSNorm and up projection and
    the shared experts run as moe_layer runs them on one rank."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    p, idx, _ = route(x2, w, cfg, choose_experts)
    z = linear(x2, w["routed_expert_down_proj.weight"]) if cfg.latent_dim is not None else x2
    w1, w3, w2 = w["experts.w1"], w["experts.w3"], w["experts.w2"]
    n_local = w1.shape[0]
    lo = ep_rank * n_local
    rows, ks = ((idx >= lo) & (idx < lo + n_local)).nonzero(as_tuple=True)   # (token, k) pairs routed here
    local = idx[rows, ks] - lo
    order = torch.argsort(local, stable=True)
    experts, counts = torch.unique_consecutive(local[order], return_counts=True)
    u = torch.zeros(x2.shape[0], w2.shape[1], dtype=acc_dtype(z.dtype), device=z.device)
    start = 0
    for e, cnt in zip(experts.tolist(), counts.tolist()):
        sel = order[start:start + cnt]
        start += cnt
        tokens = rows[sel]
        zs = z[tokens]
        y = linear(glu_act(linear(zs, w1[e]), linear(zs, w3[e]), act), w2[e])
        u.index_add_(0, tokens, acc(y) * p[tokens, ks[sel]][:, None])
    u = reduce(u).to(z.dtype)          # partial over experts -> full, before the norm
    return moe_output(u, x2, w, cfg, act, eps).reshape(shape)


def moe_output(u: torch.Tensor, x2: torch.Tensor, w: dict, cfg: MoESpec, act, eps: float) -> torch.Tensor:
    """After the routed combine u: the LatentMoE RMSNorm + up projection, plus the shared experts on x2."""
    if cfg.latent_dim is not None:
        if cfg.latent_norm:
            u = rms_norm(u, w["routed_expert_norm.weight"], eps)
        y = linear(u, w["routed_expert_up_proj.weight"])
    else:
        y = u
    if cfg.num_shared_experts:
        y = y + mlp(x2, {k[len("shared_experts."):]: v for k, v in w.items() if k.startswith("shared_experts.")},
                    act)
    return y
