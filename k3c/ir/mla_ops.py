"""Kernel-level MLA ops the `mla-absorb` pass introduces (K3.md section 3).

    mla_kvb_split   weight transform, computed once when weights load: W_kvb [N*(P+V), L] -> W_UK_T [N, P, L]
                    (part "uk_t") or W_UV [N, L, V] (part "uv")
    mla_absorbed    the MLA sublayer over the paged latent cache of its layer: latent write (RMSNorm of c fused in
                    the projection's epilogue, paged), then per call MQA mode (q_nope W_UK_T, attention over the
                    576-wide latent with one shared KV head, o_lat W_UV) or MHA mode (k_nope|v expanded from the
                    latent chunk by chunk, merged by log-sum-exp), chosen by `mode` ("auto": the cost model of
                    k3c.analysis.cost.mla_mode_costs for the (new, cached) token counts on the device's target);
                    then the output gate and o_proj. Both modes compute the same function.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import TensorType
from .layer_ops import MLA_ATTRS, expect_mla_query_and_latent
from .opdef import AttrSpec, OpDef, Role, TypeCheck, activation, check_positive, expect, fixed_roles


# ---- mla_kvb_split -------------------------------------------------------------------------------------------------
def _check_split(attrs):
    check_positive(attrs, "num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank")


def _infer_split(attrs, ins):
    n, p, v, lat = attrs["num_heads"], attrs["qk_nope_head_dim"], attrs["v_head_dim"], attrs["kv_lora_rank"]
    w = ins["kv_b_proj.weight"]
    expect(w, "kv_b_proj.weight", (n * (p + v), lat))
    shape = (n, p, lat) if attrs["part"] == "uk_t" else (n, lat, v)
    return (TensorType(w.dtype, shape),)


MLA_KVB_SPLIT = OpDef("mla_kvb_split", fixed_roles(params=("kv_b_proj.weight",)), {
    "num_heads": AttrSpec("int"),
    "qk_nope_head_dim": AttrSpec("int"),
    "v_head_dim": AttrSpec("int"),
    "kv_lora_rank": AttrSpec("int"),
    "part": AttrSpec("str", choices=("uk_t", "uv"), doc="uk_t: W_UK_T [N, P, L]; uv: W_UV [N, L, V]"),
}, _infer_split, _check_split, weight_transform=True, doc="weight transform: W_kvb -> W_UK_T or W_UV (per head)")


# ---- mla_absorbed --------------------------------------------------------------------------------------------------
def absorbed_roles(attrs: Mapping[str, Any]) -> tuple[Role, ...]:
    q = ("q_proj.weight",) if attrs.get("q_lora_rank") is None else (
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
    gate = ("g_proj.weight",) if attrs.get("output_gate") else ()
    params = (*q, "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "w_uk_t", *gate, "w_uv", "o_proj.weight")
    return (Role("x"),) + tuple(Role(p, param=True) for p in params)


def _check_absorbed(attrs):
    check_positive(attrs, "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                   "prefill_chunk")
    if attrs.get("qk_rope_head_dim", 0) < 0:
        raise TypeCheck("attribute 'qk_rope_head_dim' must be >= 0")


def _infer_absorbed(attrs, ins):
    x, d = activation(ins)
    n, p = attrs["num_heads"], attrs["qk_nope_head_dim"]
    v, lat = attrs["v_head_dim"], attrs["kv_lora_rank"]
    expect_mla_query_and_latent(attrs, ins, d)
    expect(ins["w_uk_t"], "w_uk_t", (n, p, lat))
    if attrs["output_gate"]:
        expect(ins["g_proj.weight"], "g_proj.weight", (n * v, d))
    expect(ins["w_uv"], "w_uv", (n, lat, v))
    expect(ins["o_proj.weight"], "o_proj.weight", (d, n * v))
    return (x,)


MLA_ABSORBED = OpDef("mla_absorbed", absorbed_roles, {
    **MLA_ATTRS,
    "mode": AttrSpec("str", choices=("auto", "mha", "mqa"),
                     doc="auto: the cost model picks per call from (new, cached) tokens on the device's target"),
    "prefill_chunk": AttrSpec("int", doc="MHA mode: context tokens whose K/V are expanded at once"),
}, _infer_absorbed, _check_absorbed, pure=False, sequence_state=True,
    doc="MLA sublayer over its layer's paged latent cache, absorbed (MQA) or expanded (MHA) per call")

OP_DEFS = (MLA_KVB_SPLIT, MLA_ABSORBED)
