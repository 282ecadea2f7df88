"""Closed-form cost formulas (K3.md sections 2-6, AttnRes paper section 4). Each function has a FORMULAS entry:
the text the plan report prints next to every number derived from it. Tests pin the values.

Units: FLOPs count a multiply-add as 2; bytes are bytes; GB = 1e9 bytes, GiB = 2**30 bytes.
"""
from __future__ import annotations

import math

GB = 1e9
GiB = float(2 ** 30)

FORMULAS: dict[str, str] = {
    "kda_prefill_flops": "12 C^3 + 8 C^2 D + 6 C D^2 per chunk and head (FlashKDA, K3.md s2)",
    "kda_prefill_bytes": "8 C^2 + 22 C D per chunk and head (FlashKDA, K3.md s2)",
    "kda_decode_flops": "7 D^2 per head and token (K3.md s2)",
    "kda_decode_bytes": "8 D^2 per head and token: fp32 state read + write (K3.md s2)",
    "mla_mha_pair_flops": "2(P+R) + 2V per query-key pair and head (MHA mode, K3.md s3)",
    "mla_mqa_pair_flops": "2(L+R) + 2L per query-key pair and head (MQA/absorbed mode, K3.md s3)",
    "mla_pairs": "B (T S + T(T+1)/2): causal query-key pairs for T new tokens after S cached",
    "mla_mha_expand_flops": "2 L N(P+V) per context token: W_kvb expansion (MHA mode)",
    "mla_mqa_absorb_flops": "2 N (P L + L V) per query token: W_UK_T and W_UV (MQA mode)",
    "mla_cache_bytes": "tokens x (L+R) x kv_bytes x MLA layers (latent cache, 576 values per token per layer)",
    "kda_state_bytes": "layers x heads/TP x D_k x D_v x 4 (fp32 recurrent state) per sequence",
    "conv_state_bytes": "layers x conv channels/TP x (kernel-1) x act_bytes (short-conv tails) per sequence",
    "attnres_block_bytes": "N_blocks x T x d x bytes (AttnRes paper s4.2; 8 x 128K x 7168 x bf16 = 15.03 GB)",
    "attnres_sharded_bytes": "N_blocks x ceil(T_chunk/TP) x d x bytes (sequence-sharded over TP, chunked prefill)",
    "moe_comm_compute_ratio": "T_comm/T_comp = (P F)/(6 m B) (1 - 1/E) (K3.md s5)",
    "attnres_pp_naive": "sum_{j=1}^{C-1} j N_p = N_p C(C-1)/2 blocks per token, C = P V (AttnRes paper s4.1)",
    "attnres_pp_cached": "N_p [P(P-1)/2 + (V-1) P^2] blocks per token (cross-stage caching, AttnRes paper s4.1)",
    "mxfp4_bytes": "rows x (ceil(K/2) + ceil(K/32)): E2M1 payload + one E8M0 scale per 32 (4.25 bits per weight)",
    "experts_touched": "E_local x (1 - (1 - k/E)^n): expected experts hit by n routed tokens (uniform routing)",
    "roofline_time": "max(FLOPs / peak, bytes / HBM bandwidth) per op, summed over ops",
    "allreduce_bytes": "2 (TP-1)/TP x n x d x act_bytes sent per GPU (ring all-reduce)",
    "collective_latency": "collectives per step x the target's latency per collective",
    "kv_throughput": "cache bytes(L) / predicted prefill time(L) (K3.md s7)",
    "active_params": "non-routed params - embed_tokens + routed params x top_k / E",
    "kda_checkpoints": "batch x ceil(context / interval) x (KDA state + conv tails + logits row) per GPU (prefix "
                       "cache: a checkpoint every interval tokens and at the prompt end; MLA rows are shared pages)",
}


def kda_prefill_flops(C: int, D: int) -> int:
    """Chunked KDA prefill FLOPs per chunk of C tokens and head of dim D."""
    return 12 * C ** 3 + 8 * C ** 2 * D + 6 * C * D ** 2


def kda_prefill_bytes(C: int, D: int) -> int:
    """Chunked KDA prefill HBM bytes per chunk and head."""
    return 8 * C ** 2 + 22 * C * D


def kda_decode_flops(D: int) -> int:
    """Recurrent KDA decode FLOPs per head and token."""
    return 7 * D ** 2


def kda_decode_bytes(D: int) -> int:
    """fp32 state traffic (read + write) per head and token."""
    return 8 * D ** 2


def mla_pair_flops(mode: str, *, P: int, R: int, V: int, L: int) -> int:
    """Attention FLOPs per query-key pair and head: MHA scores over P+R, values V; MQA scores over L+R, values L."""
    if mode == "mha":
        return 2 * (P + R) + 2 * V
    if mode == "mqa":
        return 2 * (L + R) + 2 * L
    raise ValueError(f"mode must be 'mha' or 'mqa', got {mode!r}")


def mla_mqa_mha_ratio(*, P: int, R: int, V: int, L: int) -> float:
    return mla_pair_flops("mqa", P=P, R=R, V=V, L=L) / mla_pair_flops("mha", P=P, R=R, V=V, L=L)


def causal_pairs(new: int, cached: int) -> int:
    """Query-key pairs of `new` causal queries after `cached` tokens, per sequence and head."""
    return new * cached + new * (new + 1) // 2


def attnres_block_bytes(blocks: int, tokens: int, hidden: int, dtype_bytes: float) -> float:
    """AttnRes prefill storage of the block representations (K3.md s4: 8 x 128K x 7168 x bf16 = 15 GB)."""
    return blocks * tokens * hidden * dtype_bytes


def moe_comm_compute_ratio(P: float, F: float, m: int, B: float, E: int) -> float:
    """T_comm / T_comp of expert-parallel MoE: P bytes per element dispatch+combine, F FLOP/s, m expert
    intermediate, B link bytes/s, E expert-parallel ranks (K3.md s5). The latent width cancels."""
    return (P * F) / (6 * m * B) * (1 - 1 / E)


def attnres_pp_naive_blocks(P: int, V: int, Np: float) -> float:
    """Blocks sent per token over all stage transitions when each one carries the full history."""
    C = P * V
    return Np * C * (C - 1) / 2


def attnres_pp_cached_blocks(P: int, V: int, Np: float) -> float:
    """Blocks sent per token with cross-stage caching: the first virtual stage accumulates normally,
    every later transition carries only the ~P N_p blocks produced since the receiver's previous chunk."""
    return Np * (P * (P - 1) / 2 + (V - 1) * P * P)


def mxfp4_bytes(rows: int, K: int) -> int:
    """MXFP4 bytes of `rows` rows of K reduction elements: two elements per byte + one E8M0 scale per 32."""
    return rows * (-(-K // 2) + -(-K // 32))


def experts_touched(local_experts: float, top_k: int, num_experts: int, tokens: float) -> float:
    """Expected number of the local experts that at least one of `tokens` routed tokens selects."""
    if tokens <= 0:
        return 0.0
    p_miss = (1.0 - top_k / num_experts) ** tokens
    return local_experts * (1.0 - p_miss)


def ring_allreduce_bytes(tp: int, payload: float) -> float:
    return 0.0 if tp <= 1 else 2 * (tp - 1) / tp * payload


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fmt_bytes(n: float) -> str:
    """'15.03 GB (14.00 GiB)'."""
    return f"{n / GB:,.2f} GB ({n / GiB:,.2f} GiB)"


def fmt_si(x: float, unit: str = "") -> str:
    if x == 0:
        return f"0 {unit}".strip()
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".strip()


def fmt_seconds(s: float) -> str:
    if s == math.inf:
        return "inf"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
