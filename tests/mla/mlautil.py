"""Shared helpers of the MLA tests: the error metric and a small gated MLA layer with random weights."""
from __future__ import annotations

import torch

from k3c.frontend.spec import MLASpec
from k3c.runtime.kernel_impls import mla as rt

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(out, want) -> float:
    out, want = out.double(), want.double()
    return ((out - want).norm() / want.norm()).item()


def layer_setup(dtype, gated=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N, P, R, V, L, D, QL = 2, 16, 8, 16, 32, 48, 24
    cfg = MLASpec(num_heads=N, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V,
                  q_lora_rank=QL, output_gate=gated)

    def r(*shape, fan):
        return (torch.randn(*shape, generator=gen) / fan ** 0.5).to(dtype)

    w = {"q_a_proj.weight": r(QL, D, fan=D), "q_a_layernorm.weight": (1 + 0.1 * torch.randn(QL, generator=gen)).to(dtype),
         "q_b_proj.weight": r(N * (P + R), QL, fan=QL), "kv_a_proj_with_mqa.weight": r(L + R, D, fan=D),
         "kv_a_layernorm.weight": (1 + 0.1 * torch.randn(L, generator=gen)).to(dtype),
         "kv_b_proj.weight": r(N * (P + V), L, fan=L), "o_proj.weight": r(D, N * V, fan=N * V)}
    if gated:
        w["g_proj.weight"] = r(N * V, D, fan=D)
    attrs = {"layer": 0, "num_heads": N, "q_lora_rank": QL, "kv_lora_rank": L, "qk_nope_head_dim": P,
             "qk_rope_head_dim": R, "v_head_dim": V, "rope": "none", "output_gate": gated, "lora_norm_eps": 1e-6,
             "causal": True, "mode": "auto", "prefill_chunk": 8}
    wa = dict(w)
    wa["w_uk_t"] = rt.split_kvb(w["kv_b_proj.weight"], N, P, V, "uk_t")
    wa["w_uv"] = rt.split_kvb(w["kv_b_proj.weight"], N, P, V, "uv")
    return cfg, w, wa, attrs, gen
