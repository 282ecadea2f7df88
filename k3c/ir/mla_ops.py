"""Kernel-level MLA ops the `mla-absorb` pass introduces (K3.md section 3).

    mla_kvb_split   weight transform, computed once when weights load: W_kvb [N*(P+V), L] -> W_UK_T [N, P, L]
                    (part "uk_t") or W_UV [N, L, V] (part "uv")
    mla_fold_uv_o   weight transform W_o [D, N*V] x W_UV -> W_o_uv [D, N*L] (folding W_UV into o_proj). Legal only
                    for MLA without the output gate: the verifier rejects an mla_absorbed that uses it when gated
    mla_absorbed    the MLA sublayer over the paged latent cache of its layer: latent write (RMSNorm of c fused in
                    the projection's epilogue, paged), then per call MQA mode (q_nope W_UK_T, attention over the
                    576-wide latent with one shared KV head, o_lat W_UV) or MHA mode (k_nope|v expanded from the
                    latent chunk by chunk, merged by log-sum-exp), chosen by `mode` ("auto": the cost model of
                    k3c.analysis.cost.mla_mode_costs for the (new, cached) token counts on the device's target);
                    then the output gate and o_proj. Both modes compute the same function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .core import TensorType
from .ops import AttrSpec, OpDef, Role, TypeCheck, activation, expect, fixed_roles, register_op, require
from .layer_ops import MLA_ATTRS, expect_mla_query_and_latent


@dataclass(frozen=True)
class WeightTransformOpDef(OpDef):
    """An op over weights only: evaluated once when weights load (codegen marks it impl="extern")."""
    weight_transform: bool = True


# ---- mla_kvb_split -------------------------------------------------------------------------------------------------
def _check_split(attrs):
    for n in ("num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
        if attrs.get(n) is not None and attrs[n] < 1:
            raise TypeCheck(f"attribute '{n}' must be >= 1, got {attrs[n]}")


def _infer_split(attrs, ins):
    n, p, v, lat = attrs["num_heads"], attrs["qk_nope_head_dim"], attrs["v_head_dim"], attrs["kv_lora_rank"]
    w = ins["kv_b_proj.weight"]
    expect(w, "kv_b_proj.weight", (n * (p + v), lat))
    shape = (n, p, lat) if attrs["part"] == "uk_t" else (n, lat, v)
    return (TensorType(w.dtype, shape),)


register_op(WeightTransformOpDef("mla_kvb_split", fixed_roles(params=("kv_b_proj.weight",)), {
    "num_heads": AttrSpec("int"),
    "qk_nope_head_dim": AttrSpec("int"),
    "v_head_dim": AttrSpec("int"),
    "kv_lora_rank": AttrSpec("int"),
    "part": AttrSpec("str", choices=("uk_t", "uv"), doc="uk_t: W_UK_T [N, P, L]; uv: W_UV [N, L, V]"),
}, _infer_split, _check_split, doc="weight transform: W_kvb -> W_UK_T or W_UV (per head)"))


# ---- mla_fold_uv_o -------------------------------------------------------------------------------------------------
def _infer_fold(attrs, ins):
    uv, wo = ins["w_uv"], ins["o_proj.weight"]
    require(uv.rank == 3, f"w_uv: expected [N, L, V], got {uv}")
    n, lat, v = uv.shape
    require(wo.rank == 2 and wo.shape[1] == n * v, f"o_proj.weight: expected [D, {n * v}], got {wo}")
    return (TensorType(wo.dtype, (wo.shape[0], n * lat)),)


register_op(WeightTransformOpDef("mla_fold_uv_o", fixed_roles(params=("w_uv", "o_proj.weight")), {},
                                 _infer_fold, doc="weight transform: W_o_uv[:, n] = W_o[:, n] W_UV[n]^T (ungated only)"))


# ---- mla_absorbed --------------------------------------------------------------------------------------------------
def absorbed_roles(attrs: Mapping[str, Any]) -> tuple[Role, ...]:
    q = ("q_proj.weight",) if attrs.get("q_lora_rank") is None else (
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
    gate = ("g_proj.weight",) if attrs.get("output_gate") else ()
    out = ("w_o_uv",) if attrs.get("fold_uv_into_o_proj") else ("w_uv", "o_proj.weight")
    params = (*q, "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "w_uk_t", *gate, *out)
    return (Role("x"),) + tuple(Role(p, param=True) for p in params)


def _check_absorbed(attrs):
    for n in ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "prefill_chunk"):
        if attrs.get(n) is not None and attrs[n] < 1:
            raise TypeCheck(f"attribute '{n}' must be >= 1, got {attrs[n]}")
    if attrs.get("qk_rope_head_dim", 0) < 0:
        raise TypeCheck("attribute 'qk_rope_head_dim' must be >= 0")
    if attrs.get("fold_uv_into_o_proj"):
        if attrs.get("output_gate"):
            raise TypeCheck("W_UV cannot be folded into o_proj in gated MLA: the output gate multiplies "
                            "o = o_lat W_UV per head and channel between W_UV and o_proj")
        if attrs.get("mode") != "mqa":
            raise TypeCheck("fold_uv_into_o_proj needs mode 'mqa' (MHA mode needs W_UV for the values)")


def _infer_absorbed(attrs, ins):
    x, d = activation(ins)
    n, p = attrs["num_heads"], attrs["qk_nope_head_dim"]
    v, lat = attrs["v_head_dim"], attrs["kv_lora_rank"]
    expect_mla_query_and_latent(attrs, ins, d)
    expect(ins["w_uk_t"], "w_uk_t", (n, p, lat))
    if attrs["output_gate"]:
        expect(ins["g_proj.weight"], "g_proj.weight", (n * v, d))
    if attrs.get("fold_uv_into_o_proj"):
        expect(ins["w_o_uv"], "w_o_uv", (d, n * lat))
    else:
        expect(ins["w_uv"], "w_uv", (n, lat, v))
        expect(ins["o_proj.weight"], "o_proj.weight", (d, n * v))
    return (x,)


register_op(OpDef("mla_absorbed", absorbed_roles, {
    **MLA_ATTRS,
    "mode": AttrSpec("str", choices=("auto", "mha", "mqa"),
                     doc="auto: the cost model picks per call from (new, cached) tokens on the device's target"),
    "prefill_chunk": AttrSpec("int", doc="MHA mode: context tokens whose K/V are expanded at once"),
    "fold_uv_into_o_proj": AttrSpec("bool", required=False, doc="W_UV folded into o_proj (ungated MLA only)"),
}, _infer_absorbed, _check_absorbed, pure=False,
    doc="MLA sublayer over its layer's paged latent cache, absorbed (MQA) or expanded (MHA) per call"))
