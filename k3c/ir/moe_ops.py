"""Kernel-level (Latent)MoE ops the `moe-lower` pass introduces (K3.md section 5). Tokens are the leading dims
[...] of x; S = tokens x k slots, held as [..., k] so no shape needs arithmetic.

    moe_linear    y = x W^T (+ residual): the router logits (out f32), the latent down projection and the latent up
                  projection (residual = the shared experts' output)
    moe_route     (weights f32 [..., k], ids i32 [..., k], expert_off i32 [5, E_local + 1], perm i32 [..., k])
                  from the fp32 router logits (+ e_score_correction_bias): sigmoid/softmax scores, top-k of
                  score + bias, renormalise, scale; the offsets of each local expert's rows (row 0) and M tiles
                  (rows 1-4, one per BLOCK_M bucket of the grouped GEMMs), and the stable permutation of the
                  (token, k) slots by expert (perm[row] = t * k + j)
    moe_gate_up   h [..., k, M] in permuted row order: act(z W1_e^T, z W3_e^T) for each row's expert, z gathered by
                  perm (grouped GEMM, one launch for all experts)
    moe_down      y [..., k, Z] in slot order: h W2_e^T, rows scattered back through perm
    moe_combine   u [..., Z] = sum_j weights[..., j] y[..., j, :] (+ residual); with expert parallelism only
                  this rank's experts' slots (a partial sum the all_reduce completes)
Expert weights: bf16 stacks `experts.w1` [E_local, M, Z] ..., or with expert_format "mxfp4" packed u8
`experts.w1.weight_packed` [E_local, M, Z/2] + `experts.w1.weight_scale` [E_local, M, Z/32] pairs.
`expert_layout` "hopper" (sm_90 targets, set by moe-lower): weight preparation rearranges those stacks' bytes into
k3c.codegen.kernels.moe_hopper's layout (shapes unchanged; checkpoints stay in k3c.quant's layout).
`mx` says how the MXFP4 GEMMs run: "upcast" (decoded in registers, bf16 dot) or "e4m3" / "e2m1" (tl.dot_scaled on
the target's MX matrix units with the activations quantized per 32 in registers), "auto" (the pass's choice: decided
by the target the kernels are emitted / run for, with `act_format`); "none" for bf16 weights.
"""
from __future__ import annotations

from typing import Any

from .core import TensorType
from .layer_ops import ACT_ATTRS, check_activation, check_expert_parallel
from .mxfp4_weights import MX_ATTRS, is_mxfp4, linear_weight, packed_roles
from .opdef import AttrSpec, OpDef, Role, TypeCheck, activation, check_positive, expect, require

U8 = frozenset({"u8"})
OFFSET_ROWS = 5         # expert row offsets + tile offsets for the 4 BLOCK_M buckets (k3c.codegen.kernels.moe)
MX = ("auto", "none", "upcast", "e4m3", "e2m1")
EXPERT_LAYOUTS = ("canonical", "hopper")     # load-time layouts of MXFP4 expert stacks (runtime.weight_prep)


def _local_experts(attrs) -> int:
    """E_local: the experts this rank holds (num_experts / ep_size)."""
    return attrs["num_experts"] // attrs.get("ep_size", 1)


EP_ATTRS = {
    "ep_rank": AttrSpec("int", required=False, doc="expert-parallel rank; absent = 0"),
    "ep_size": AttrSpec("int", required=False, doc="expert-parallel ranks; absent = 1"),
}


# ---- moe_linear ---------------------------------------------------------------------------------------------------
def _linear_roles(attrs):
    w = packed_roles("weight") if is_mxfp4(attrs) else (Role("weight", param=True),)
    return (Role("x"),) + w + ((Role("residual"),) if attrs.get("residual") else ())


def _check_linear(attrs):
    if is_mxfp4(attrs) and attrs.get("proj") == "router":
        raise TypeCheck("the router GEMM stays float (weight_format mxfp4 is for the latent projections)")


def _infer_linear(attrs, ins):
    x, d = activation(ins)
    w = linear_weight(ins, "weight", is_mxfp4(attrs))
    require(w.rank == 2, f"weight: expected [out, in], got {w}")
    expect(w, "weight", (None, d))
    out = TensorType("f32" if attrs.get("out_f32") else x.dtype, x.shape[:-1] + (w.shape[0],))
    if attrs.get("residual"):
        require(ins["residual"] == out, f"residual: expected {out}, got {ins['residual']}")
    return (out,)


MOE_LINEAR = OpDef("moe_linear", _linear_roles, {
    "proj": AttrSpec("str", choices=("router", "latent_down", "latent_up")),
    "out_f32": AttrSpec("bool", required=False, doc="fp32 result (the router logits)"),
    "residual": AttrSpec("bool", required=False, doc="+ residual in the epilogue"),
    **MX_ATTRS,
}, _infer_linear, _check_linear, doc="dense GEMM of a MoE layer: x W^T (+ residual), generated GEMM kernel")


# ---- moe_route ----------------------------------------------------------------------------------------------------
def _route_roles(attrs):
    return (Role("logits"),) + ((Role("gate.e_score_correction_bias", param=True),) if attrs.get("router_bias")
                                else ())


def _check_route(attrs):
    check_positive(attrs, "num_experts", "top_k")
    if attrs.get("top_k", 0) > attrs.get("num_experts", 0):
        raise TypeCheck(f"top_k {attrs.get('top_k')} exceeds num_experts {attrs.get('num_experts')}")
    check_expert_parallel(attrs)


def _infer_route(attrs, ins):
    lg = ins["logits"]
    e, k = attrs["num_experts"], attrs["top_k"]
    require(lg.dtype == "f32" and lg.rank >= 1 and lg.shape[-1] == e, f"logits: expected f32[..., {e}], got {lg}")
    if attrs["router_bias"]:
        expect(ins["gate.e_score_correction_bias"], "gate.e_score_correction_bias", (e,))
    lead = lg.shape[:-1] + (k,)
    el = _local_experts(attrs)
    return (TensorType("f32", lead), TensorType("i32", lead), TensorType("i32", (OFFSET_ROWS, el + 1)),
            TensorType("i32", lead))


ROUTE_ATTRS = {
    "num_experts": AttrSpec("int"),
    "top_k": AttrSpec("int"),
    "router_activation": AttrSpec("str", choices=("sigmoid", "softmax")),
    "router_bias": AttrSpec("bool"),
    "renormalize": AttrSpec("bool"),
    "routed_scaling_factor": AttrSpec("float"),
    **EP_ATTRS,
}
MOE_ROUTE = OpDef("moe_route", _route_roles, ROUTE_ATTRS, _infer_route, _check_route, num_results=4,
                  doc="routing: top-k weights and ids, expert offsets, stable slot permutation")


# ---- grouped expert GEMMs -----------------------------------------------------------------------------------------
def expert_roles(names: tuple[str, ...], fmt: str) -> tuple[Role, ...]:
    if fmt == "mxfp4":
        return tuple(Role(f"experts.{n}.{p}", param=True) for n in names for p in ("weight_packed", "weight_scale"))
    return tuple(Role(f"experts.{n}", param=True) for n in names)


def _check_grouped(attrs):
    check_positive(attrs, "num_experts", "top_k")
    check_expert_parallel(attrs)
    fmt, mx = attrs.get("expert_format", "bf16"), attrs.get("mx", "none")
    if (fmt == "mxfp4") == (mx == "none"):
        raise TypeCheck(f"mx '{mx}' does not fit expert_format '{fmt}'")
    if attrs.get("expert_layout", "canonical") == "hopper" and (fmt != "mxfp4" or mx not in ("auto", "upcast")):
        raise TypeCheck(f"expert_layout 'hopper' is a layout of MXFP4 experts run by the upcast GEMMs; got "
                        f"expert_format '{fmt}', mx '{mx}'")


def _expert_shape(ins, name: str, fmt: str, el: int, rows, cols) -> tuple[Any, Any]:
    """Check one expert stack; returns (out rows, reduction cols) as its shape says."""
    if fmt == "mxfp4":
        p = ins[f"experts.{name}.weight_packed"]
        require(p.rank == 3, f"experts.{name}.weight_packed: expected [E, out, in/2], got {p}")
        expect(p, f"experts.{name}.weight_packed", (el, rows, None if cols is None else cols // 2), U8)
        out, red = p.shape[1], p.shape[2] * 2
        expect(ins[f"experts.{name}.weight_scale"], f"experts.{name}.weight_scale", (el, out, red // 32), U8)
        return out, red
    w = ins[f"experts.{name}"]
    expect(w, f"experts.{name}", (el, rows, cols))
    return w.shape[1], w.shape[2]


def _gate_up_roles(attrs):
    return (Role("z"), Role("expert_off"), Role("perm")) + expert_roles(("w1", "w3"), attrs.get("expert_format",
                                                                                                  "bf16"))


def _infer_gate_up(attrs, ins):
    z, zd = activation(ins, "z")
    fmt, el, k = attrs.get("expert_format", "bf16"), _local_experts(attrs), attrs["top_k"]
    m, _ = _expert_shape(ins, "w1", fmt, el, None, zd)
    _expert_shape(ins, "w3", fmt, el, m, zd)
    expect(ins["expert_off"], "expert_off", (OFFSET_ROWS, el + 1), frozenset({"i32"}))
    expect(ins["perm"], "perm", z.shape[:-1] + (k,), frozenset({"i32"}))
    return (TensorType(z.dtype, z.shape[:-1] + (k, m)),)


GROUPED_ATTRS = {
    "num_experts": AttrSpec("int", doc="experts of the whole layer (E_local = num_experts / ep_size here)"),
    "top_k": AttrSpec("int"),
    "expert_format": AttrSpec("str", required=False, choices=("bf16", "mxfp4")),
    "mx": AttrSpec("str", choices=MX, doc="how MXFP4 weights run: auto (by the target that runs it, "
                                          "k3c.codegen.kernels.moe.mx_mode) | upcast | e4m3 | e2m1; none for bf16"),
    "act_format": AttrSpec("str", required=False, choices=("bf16", "mxfp8", "mxfp4"),
                           doc="the spec's activation format (native MX GEMMs quantize to it); absent = bf16"),
    "expert_layout": AttrSpec("str", required=False, choices=EXPERT_LAYOUTS,
                              doc="load-time layout of the MXFP4 expert stacks (the target's, moe-lower): canonical "
                                  "(k3c.quant's; absent) or hopper (k3c.codegen.kernels.moe_hopper; upcast only)"),
    **EP_ATTRS,
}
def _check_gate_up(attrs):
    _check_grouped(attrs)
    check_activation(attrs)


MOE_GATE_UP = OpDef("moe_gate_up", _gate_up_roles, {**GROUPED_ATTRS, **ACT_ATTRS}, _infer_gate_up, _check_gate_up,
                    doc="grouped gate/up GEMM of the routed experts with the GLU epilogue (permuted rows)")


def _down_roles(attrs):
    return (Role("h"), Role("expert_off"), Role("perm")) + expert_roles(("w2",), attrs.get("expert_format", "bf16"))


def _infer_down(attrs, ins):
    h = ins["h"]
    fmt, el, k = attrs.get("expert_format", "bf16"), _local_experts(attrs), attrs["top_k"]
    require(h.rank >= 2 and h.shape[-2] == k, f"h: expected [..., {k}, M], got {h}")
    zd, _ = _expert_shape(ins, "w2", fmt, el, None, h.shape[-1])
    expect(ins["expert_off"], "expert_off", (OFFSET_ROWS, el + 1), frozenset({"i32"}))
    expect(ins["perm"], "perm", h.shape[:-1], frozenset({"i32"}))
    return (TensorType(h.dtype, h.shape[:-1] + (zd,)),)


MOE_DOWN = OpDef("moe_down", _down_roles, GROUPED_ATTRS, _infer_down, _check_grouped,
                 doc="grouped down GEMM of the routed experts; rows back in slot order")


# ---- combine ------------------------------------------------------------------------------------------------------
def _combine_roles(attrs):
    return (Role("y"), Role("weights"), Role("ids")) + ((Role("residual"),) if attrs.get("residual") else ())


def _infer_combine(attrs, ins):
    y, w, ids = ins["y"], ins["weights"], ins["ids"]
    k = attrs["top_k"]
    require(y.rank >= 2 and y.shape[-2] == k, f"y: expected [..., {k}, Z], got {y}")
    expect(w, "weights", y.shape[:-1], frozenset({"f32"}))
    expect(ids, "ids", y.shape[:-1], frozenset({"i32"}))
    out = TensorType(y.dtype, y.shape[:-2] + (y.shape[-1],))
    if attrs.get("residual"):
        require(ins["residual"] == out, f"residual: expected {out}, got {ins['residual']}")
    return (out,)


def _check_combine(attrs):
    check_positive(attrs, "num_experts", "top_k")
    check_expert_parallel(attrs)


MOE_COMBINE = OpDef("moe_combine", _combine_roles, {
    "num_experts": AttrSpec("int"),
    "top_k": AttrSpec("int"),
    "residual": AttrSpec("bool", required=False, doc="+ residual (the shared experts)"),
    **EP_ATTRS,
}, _infer_combine, _check_combine,
    doc="weighted sum of each token's k expert outputs (this rank's experts only under expert parallelism)")

OP_DEFS = (MOE_LINEAR, MOE_ROUTE, MOE_GATE_UP, MOE_DOWN, MOE_COMBINE)
