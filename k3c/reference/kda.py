"""Kimi Delta Attention (K3.md section 2): short convolutions, gates, the delta-rule recurrence (naive and chunked
UT/WY forms) and the whole layer. Tensors are [B, T, H, D] (fla's layout); the state is [B, H, K, V] in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..frontend.spec import KDASpec
from .norms import acc, acc_dtype, l2_norm, linear, rms_norm


@dataclass(frozen=True)
class KDAState:
    """What a KDA layer carries from one segment to the next (per sequence, independent of length).

    state: [B, H, K, V] fp32 recurrent state.
    conv:  (q, k, v) short-conv tails, each [B, H*K, kernel-1] in the compute dtype: the last kernel-1 *pre-conv*
           projections, so the next segment's causal convolution continues exactly (zeros = left padding).
    """

    state: torch.Tensor
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def kda_zero_state(cfg: KDASpec, batch: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> KDAState:
    s = torch.zeros(batch, cfg.num_heads, cfg.head_dim, cfg.head_dim, dtype=acc_dtype(dtype), device=device)
    tail = torch.zeros(batch, cfg.width, cfg.conv_kernel - 1, dtype=dtype, device=device)
    return KDAState(s, (tail, tail, tail))


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv (no bias) + SiLU. x [B, T, C], weight [C, 1, kernel], tail [B, C, kernel-1] or None
    (zeros). Returns (y [B, T, C], new tail = the last kernel-1 inputs, older tail included when T < kernel-1)."""
    b, t, c = x.shape
    kernel = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(b, c, kernel - 1)
    xc = torch.cat([tail.to(x.dtype), x.transpose(1, 2)], dim=-1)            # [B, C, kernel-1+T]
    y = F.conv1d(xc, weight.to(x.dtype), groups=c)                           # valid conv -> [B, C, T]
    return F.silu(y).transpose(1, 2), xc[..., xc.shape[-1] - (kernel - 1):]


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, cfg: KDASpec) -> torch.Tensor:
    """Log-space decay g <= 0, fp32 [..., H, K], from the low-rank forget projection f [..., H*K]."""
    h, k = cfg.num_heads, cfg.head_dim
    x = (acc(f) + acc(dt_bias)).unflatten(-1, (h, k))
    a = acc(A_log).exp()[:, None]                                         # [H, 1]
    if cfg.gate == "softplus":
        return -a * F.softplus(x)                                            # softplus is linear above 20 (as fla)
    return cfg.gate_lower_bound * torch.sigmoid(a * x)                       # safe gate: g in (lb, 0)


def kda_recurrent(q, k, v, g, beta, scale: float | None = None, initial_state: torch.Tensor | None = None):
    """The recurrence token by token. q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H].
    Returns (o [B, T, H, V] fp32, final state [B, H, K, V] fp32)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    q, k, v, g, beta = (acc(x) for x in (q, k, v, g, beta))
    s = q.new_zeros(b, h, dk, dv) if initial_state is None else acc(initial_state).clone()
    o = q.new_empty(b, t, h, dv)
    for i in range(t):
        s = s * g[:, i].exp()[..., None]                                     # S~ = Diag(e^g) S
        kv = torch.einsum("bhk,bhkv->bhv", k[:, i], s)                       # S~^T k
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, i, :, None] * k[:, i], v[:, i] - kv)
        o[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, s)
    return o, s


def kda_chunked(q, k, v, g, beta, scale: float | None = None, initial_state: torch.Tensor | None = None,
                chunk_size: int = 64):
    """The chunked UT/WY form of K3.md section 2; same contract as kda_recurrent. The last chunk may be short.

    Numerics: intra-chunk decays are formed as e^(Gamma_i - Gamma_j) from the pairwise difference (<= 0 where used),
    never as e^Gamma_i * e^-Gamma_j, which overflows once a span's log-decay passes ~-88 (5 tokens at lb = -5 with
    64-token chunks is enough). (I + A_kk) is unit lower triangular: solved, not inverted.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    # [B, H, T, D] so per-chunk math is batched matmuls over (B, H)
    q, k, v, g = (acc(x).transpose(1, 2) for x in (q, k, v, g))
    beta = acc(beta).transpose(1, 2)
    s = q.new_zeros(b, h, dk, dv) if initial_state is None else acc(initial_state).clone()
    o = q.new_empty(b, h, t, dv)
    for start in range(0, t, chunk_size):
        sl = slice(start, min(start + chunk_size, t))
        o[:, :, sl], s = kda_chunk_step(q[:, :, sl] * scale, k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], s)
    return o.transpose(1, 2), s


def kda_chunk_step(qc, kc, vc, gc, bc, s):
    """One chunk of kda_chunked: qc (already scaled), kc, gc [B, H, C, K]; vc [B, H, C, V]; bc [B, H, C]; state
    s [B, H, K, V], all fp32. Returns (o [B, H, C, V], the state after the chunk). Its own function so that a
    compiler peer (bench/e2e.py) can compile the chunk body once instead of unrolling the chunk loop."""
    gam = gc.cumsum(-2)                                                      # Gamma [B, H, C, K]
    c = gam.shape[-2]
    incl = torch.ones(c, c, dtype=torch.bool, device=qc.device).tril()      # j <= i
    diff = gam[:, :, :, None, :] - gam[:, :, None, :, :]                     # Gamma_i - Gamma_j [B, H, C, C, K]
    decay = torch.where(incl[..., None], diff, float("-inf")).exp()          # 0 above the diagonal
    a_kk = (kc[:, :, :, None, :] * kc[:, :, None, :, :] * decay).sum(-1) * bc[..., None]
    a_kk = a_kk.tril(-1)                                                     # strictly lower
    a_qk = (qc[:, :, :, None, :] * kc[:, :, None, :, :] * decay).sum(-1)    # j <= i, scale already in qc
    m = a_kk + torch.eye(c, device=qc.device)
    w = torch.linalg.solve_triangular(m, bc[..., None] * (kc * gam.exp()), upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(m, bc[..., None] * vc, upper=False, unitriangular=True)
    v_new = u - w @ s
    o = (qc * gam.exp()) @ s + a_qk @ v_new
    last = gam[:, :, -1:, :]                                                 # Gamma_C
    s = last.transpose(-1, -2).exp() * s + (kc * (last - gam).exp()).transpose(-1, -2) @ v_new
    return o, s


KDAMode = Literal["auto", "chunk", "recurrent"]


def kda_layer(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: KDASpec, eps: float,
              state: KDAState | None = None, *, mode: KDAMode = "auto", chunk_size: int = 64
              ) -> tuple[torch.Tensor, KDAState]:
    """One KDA layer on x [B, T, hidden] (already normed), continuing from `state` (None = fresh sequence).
    `w` holds the layer's weights without the `layers.{i}.self_attn.` prefix; eps is spec.rms_norm_eps (o_norm).
    mode "auto": recurrent for a single token (decode), chunked otherwise. Returns (y [B, T, hidden], new state);
    the input state is not modified."""
    b, t, _ = x.shape
    h, dk = cfg.num_heads, cfg.head_dim
    if state is None:
        state = kda_zero_state(cfg, b, x.dtype, x.device)
    feats, tails = [], []
    for name, tail in zip("qkv", state.conv):
        y, new_tail = short_conv(linear(x, w[f"{name}_proj.weight"]), w[f"{name}_conv1d.weight"], tail)
        feats.append(y.unflatten(-1, (h, dk)))
        tails.append(new_tail)
    q, k, v = l2_norm(feats[0]), l2_norm(feats[1]), acc(feats[2])
    g = kda_gate(linear(linear(x, w["f_a_proj.weight"]), w["f_b_proj.weight"]), w["A_log"], w["dt_bias"], cfg)
    beta = torch.sigmoid(acc(linear(x, w["b_proj.weight"])))
    use_recurrent = mode == "recurrent" or (mode == "auto" and t == 1)
    if use_recurrent:
        o, s = kda_recurrent(q, k, v, g, beta, initial_state=state.state)
    else:
        o, s = kda_chunked(q, k, v, g, beta, initial_state=state.state, chunk_size=chunk_size)
    if cfg.output_gate == "full_rank":
        gate = linear(x, w["g_proj.weight"])
    else:
        gate = linear(linear(x, w["g_a_proj.weight"]), w["g_b_proj.weight"])
    # per-head RMSNorm in fp32 (o is fp32), then the sigmoid output gate, then back to the compute dtype
    o = rms_norm(o, w["o_norm.weight"], eps) * torch.sigmoid(acc(gate).unflatten(-1, (h, dk)))
    y = linear(o.to(x.dtype).flatten(-2), w["o_proj.weight"])
    return y, KDAState(s, (tails[0], tails[1], tails[2]))
