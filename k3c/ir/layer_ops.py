"""Layer-level ops emitted by the frontend: kda, mla, mlp, moe, attn_res_mix (K3.md sections 2-5).

Each op takes the hidden state (already normed) plus its weights, named by their canonical suffixes, and returns
the sublayer output with the input's type. Attrs hold what a kernel or the eager reference needs; widths that the
weights already fix (forget-gate rank, intermediate sizes) are read from the param shapes, so they cannot disagree.
"""
from __future__ import annotations

from typing import Any, Mapping

from .mxfp4_weights import MX_ATTRS, is_mxfp4, linear_weight, packed_roles
from .opdef import AttrSpec, OpDef, Role, TypeCheck, activation, check_positive, expect, require

ACTIVATIONS = ("situ", "swiglu")


def check_activation(attrs: Mapping[str, Any]) -> None:
    betas = [k for k in ("situ_beta_gate", "situ_beta_up") if k in attrs]
    if attrs.get("activation") == "situ" and len(betas) != 2:
        raise TypeCheck("activation 'situ' needs attributes situ_beta_gate and situ_beta_up")
    if attrs.get("activation") == "swiglu" and betas:
        raise TypeCheck(f"attribute '{betas[0]}' only applies to activation 'situ'")


ACT_ATTRS = {
    "activation": AttrSpec("str", choices=ACTIVATIONS),
    "situ_beta_gate": AttrSpec("float", required=False, doc="SiTU-GLU gate beta (4.0 in K3)"),
    "situ_beta_up": AttrSpec("float", required=False, doc="SiTU-GLU up beta (25.0 in K3)"),
}


# ---- KDA -------------------------------------------------------------------------------------------------
def kda_roles(attrs: Mapping[str, Any]) -> tuple[Role, ...]:
    gate = ("g_proj.weight",) if attrs.get("output_gate") == "full_rank" else ("g_a_proj.weight", "g_b_proj.weight")
    params = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
              "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", *gate, "A_log", "dt_bias",
              "o_norm.weight", "o_proj.weight")
    return (Role("x"),) + tuple(Role(p, param=True) for p in params)


def _check_kda(attrs):
    check_positive(attrs, "num_heads", "head_dim", "conv_kernel")
    if attrs.get("gate") == "safe" and not attrs.get("gate_lower_bound", -1.0) < 0:
        raise TypeCheck("the safe gate needs gate_lower_bound < 0")


def _infer_kda(attrs, ins):
    x, d = activation(ins)
    h, k = attrs["num_heads"], attrs["head_dim"]
    w = h * k
    for p in "qkv":
        expect(ins[f"{p}_proj.weight"], f"{p}_proj.weight", (w, d))
        expect(ins[f"{p}_conv1d.weight"], f"{p}_conv1d.weight", (w, 1, attrs["conv_kernel"]))
    fa = ins["f_a_proj.weight"]
    expect(fa, "f_a_proj.weight", (None, d))
    expect(ins["f_b_proj.weight"], "f_b_proj.weight", (w, fa.shape[0]))
    expect(ins["b_proj.weight"], "b_proj.weight", (h, d))
    if attrs["output_gate"] == "full_rank":
        expect(ins["g_proj.weight"], "g_proj.weight", (w, d))
    else:
        ga = ins["g_a_proj.weight"]
        expect(ga, "g_a_proj.weight", (None, d))
        expect(ins["g_b_proj.weight"], "g_b_proj.weight", (w, ga.shape[0]))
    expect(ins["A_log"], "A_log", (h,))
    expect(ins["dt_bias"], "dt_bias", (w,))
    expect(ins["o_norm.weight"], "o_norm.weight", (k,))
    expect(ins["o_proj.weight"], "o_proj.weight", (d, w))
    return (x,)


KDA = OpDef("kda", kda_roles, {
    "layer": AttrSpec("int"),
    "num_heads": AttrSpec("int"),
    "head_dim": AttrSpec("int"),
    "conv_kernel": AttrSpec("int"),
    "gate": AttrSpec("str", choices=("softplus", "safe")),
    "gate_lower_bound": AttrSpec("float", doc="safe gate: g = lb * sigmoid(...); unused by softplus"),
    "output_gate": AttrSpec("str", choices=("low_rank", "full_rank")),
    "norm_eps": AttrSpec("float", doc="per-head output RMSNorm eps"),
    "l2norm_eps": AttrSpec("float", doc="q/k L2 norm eps, inside the sqrt"),
}, _infer_kda, _check_kda, sequence_state=True, doc="Kimi Delta Attention sublayer, prefill (K3.md section 2)")


# ---- MLA -------------------------------------------------------------------------------------------------
def mla_roles(attrs: Mapping[str, Any]) -> tuple[Role, ...]:
    q = ("q_proj.weight",) if attrs.get("q_lora_rank") is None else (
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
    gate = ("g_proj.weight",) if attrs.get("output_gate") else ()
    params = (*q, "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", *gate, "o_proj.weight")
    return (Role("x"),) + tuple(Role(p, param=True) for p in params)


def _check_mla(attrs):
    check_positive(attrs, "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
    if attrs.get("qk_rope_head_dim", 0) < 0:
        raise TypeCheck("attribute 'qk_rope_head_dim' must be >= 0")


def expect_mla_query_and_latent(attrs, ins, d: int) -> None:
    """Shapes of the query projections and the latent (kv_a) projection, shared by `mla` and `mla_absorbed`."""
    n, p, r = attrs["num_heads"], attrs["qk_nope_head_dim"], attrs["qk_rope_head_dim"]
    lat, ql = attrs["kv_lora_rank"], attrs["q_lora_rank"]
    if ql is None:
        expect(ins["q_proj.weight"], "q_proj.weight", (n * (p + r), d))
    else:
        expect(ins["q_a_proj.weight"], "q_a_proj.weight", (ql, d))
        expect(ins["q_a_layernorm.weight"], "q_a_layernorm.weight", (ql,))
        expect(ins["q_b_proj.weight"], "q_b_proj.weight", (n * (p + r), ql))
    expect(ins["kv_a_proj_with_mqa.weight"], "kv_a_proj_with_mqa.weight", (lat + r, d))
    expect(ins["kv_a_layernorm.weight"], "kv_a_layernorm.weight", (lat,))


def _infer_mla(attrs, ins):
    x, d = activation(ins)
    n, p = attrs["num_heads"], attrs["qk_nope_head_dim"]
    v, lat = attrs["v_head_dim"], attrs["kv_lora_rank"]
    expect_mla_query_and_latent(attrs, ins, d)
    expect(ins["kv_b_proj.weight"], "kv_b_proj.weight", (n * (p + v), lat))
    if attrs["output_gate"]:
        expect(ins["g_proj.weight"], "g_proj.weight", (n * v, d))
    expect(ins["o_proj.weight"], "o_proj.weight", (d, n * v))
    return (x,)


MLA_ATTRS = {   # shared with the kernel-level mla_absorbed op (mla_ops.py)
    "layer": AttrSpec("int"),
    "num_heads": AttrSpec("int"),
    "q_lora_rank": AttrSpec("int", nullable=True, doc="none: q = W_q x"),
    "kv_lora_rank": AttrSpec("int"),
    "qk_nope_head_dim": AttrSpec("int"),
    "qk_rope_head_dim": AttrSpec("int"),
    "v_head_dim": AttrSpec("int"),
    "rope": AttrSpec("str", choices=("none",), doc="NoPE: the rope dims are never rotated"),
    "output_gate": AttrSpec("bool"),
    "lora_norm_eps": AttrSpec("float", doc="eps of the q_a / kv_a RMSNorms"),
    "causal": AttrSpec("bool"),
}
MLA = OpDef("mla", mla_roles, MLA_ATTRS, _infer_mla, _check_mla, sequence_state=True,
            doc="gated multi-head latent attention sublayer, prefill / MHA form (K3.md section 3)")


# ---- dense MLP -------------------------------------------------------------------------------------------
MLP_WEIGHTS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _mlp_roles(a):
    if is_mxfp4(a):
        return (Role("x"),) + tuple(r for p in MLP_WEIGHTS for r in packed_roles(p))
    return (Role("x"),) + tuple(Role(p, param=True) for p in MLP_WEIGHTS)


def _infer_mlp(attrs, ins):
    x, d = activation(ins)
    packed = is_mxfp4(attrs)
    g = linear_weight(ins, "gate_proj.weight", packed)
    expect(g, "gate_proj.weight", (None, d))
    expect(linear_weight(ins, "up_proj.weight", packed), "up_proj.weight", (g.shape[0], d))
    expect(linear_weight(ins, "down_proj.weight", packed), "down_proj.weight", (d, g.shape[0]))
    return (x,)


MLP = OpDef("mlp", _mlp_roles, {"layer": AttrSpec("int"), **ACT_ATTRS, **MX_ATTRS}, _infer_mlp,
            check_activation, doc="dense gated MLP: down(act(gate x, up x)); weight_format mxfp4: all three "
                                  "weights MXFP4")


# ---- MoE -------------------------------------------------------------------------------------------------
def moe_roles(attrs: Mapping[str, Any]) -> tuple[Role, ...]:
    params = ["gate.weight"]
    if attrs.get("router_bias"):
        params.append("gate.e_score_correction_bias")
    if attrs.get("expert_format", "bf16") == "mxfp4":      # set by the mxfp4 pass
        params += [f"experts.{w}.{part}" for w in ("w1", "w3", "w2") for part in ("weight_packed", "weight_scale")]
    else:
        params += ["experts.w1", "experts.w3", "experts.w2"]
    if attrs.get("num_shared_experts", 0) > 0:
        params += [f"shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
    if attrs.get("latent_dim") is not None:
        params.append("routed_expert_down_proj.weight")
        if attrs.get("latent_norm"):
            params.append("routed_expert_norm.weight")
        params.append("routed_expert_up_proj.weight")
    packed = _mxfp4_linears(attrs)
    return (Role("x"),) + tuple(r for p in params for r in (packed_roles(p) if p in packed else (Role(p, param=True),)))


# the MoE layer's dense linears the mxfp4 pass may pack (attr mxfp4_linears; the router stays float)
MOE_DENSE_LINEARS = ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                     "shared_experts.down_proj.weight", "routed_expert_down_proj.weight",
                     "routed_expert_up_proj.weight")


def _mxfp4_linears(attrs) -> tuple:
    v = attrs.get("mxfp4_linears", ())
    return v if isinstance(v, tuple) else ()


def _check_moe(attrs):
    check_positive(attrs, "num_experts", "top_k", "latent_dim")
    check_activation(attrs)
    if attrs.get("num_shared_experts", 0) < 0:
        raise TypeCheck("attribute 'num_shared_experts' must be >= 0")
    if attrs.get("top_k", 0) > attrs.get("num_experts", 0):
        raise TypeCheck(f"top_k {attrs.get('top_k')} exceeds num_experts {attrs.get('num_experts')}")
    if attrs.get("latent_norm") and attrs.get("latent_dim") is None:
        raise TypeCheck("latent_norm needs latent_dim")
    lin = _mxfp4_linears(attrs)
    bad = [r for r in lin if r not in MOE_DENSE_LINEARS]
    if bad:
        raise TypeCheck(f"mxfp4_linears: '{bad[0]}' is not a dense linear of the MoE layer that can be MXFP4 (one of "
                        f"{', '.join(MOE_DENSE_LINEARS)}; the router stays float)")
    shared = [r for r in lin if r.startswith("shared_experts.")]
    if shared and len(shared) != 3:
        raise TypeCheck("mxfp4_linears: the shared experts' gate_proj, up_proj and down_proj are MXFP4 together")
    if any(r.startswith("shared_experts.") for r in lin) and not attrs.get("num_shared_experts", 0):
        raise TypeCheck("mxfp4_linears names shared-expert weights but num_shared_experts is 0")
    if any(r.startswith("routed_expert_") for r in lin) and attrs.get("latent_dim") is None:
        raise TypeCheck("mxfp4_linears names latent projections but latent_dim is none")
    check_expert_parallel(attrs)


def check_expert_parallel(attrs: Mapping[str, Any]) -> None:
    """ep_rank in [0, ep_size) and num_experts divisible by ep_size (absent: rank 0 of 1)."""
    ep_rank, ep_size = attrs.get("ep_rank", 0), attrs.get("ep_size", 1)
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise TypeCheck(f"ep_rank {ep_rank} must be in [0, ep_size {ep_size})")
    if attrs.get("num_experts", 0) % ep_size:
        raise TypeCheck(f"num_experts {attrs.get('num_experts')} is not divisible by ep_size {ep_size}")


def _infer_moe(attrs, ins):
    x, d = activation(ins)
    e = attrs["num_experts"]
    z = attrs["latent_dim"] if attrs["latent_dim"] is not None else d
    expect(ins["gate.weight"], "gate.weight", (e, d))
    if attrs["router_bias"]:
        expect(ins["gate.e_score_correction_bias"], "gate.e_score_correction_bias", (e,))
    el = e // attrs.get("ep_size", 1)           # this rank's experts: [ep_rank * el, (ep_rank + 1) * el)
    if attrs.get("expert_format", "bf16") == "mxfp4":
        _expect_mxfp4_experts(ins, el, z)
    else:
        w1 = ins["experts.w1"]
        expect(w1, "experts.w1", (el, None, z))
        m = w1.shape[1]
        expect(ins["experts.w3"], "experts.w3", (el, m, z))
        expect(ins["experts.w2"], "experts.w2", (el, z, m))
    lin = _mxfp4_linears(attrs)

    def lw(role):
        return linear_weight(ins, role, role in lin)

    if attrs["num_shared_experts"] > 0:
        g = lw("shared_experts.gate_proj.weight")
        expect(g, "shared_experts.gate_proj.weight", (None, d))
        expect(lw("shared_experts.up_proj.weight"), "shared_experts.up_proj.weight", (g.shape[0], d))
        expect(lw("shared_experts.down_proj.weight"), "shared_experts.down_proj.weight", (d, g.shape[0]))
    if attrs["latent_dim"] is not None:
        expect(lw("routed_expert_down_proj.weight"), "routed_expert_down_proj.weight", (z, d))
        if attrs["latent_norm"]:
            expect(ins["routed_expert_norm.weight"], "routed_expert_norm.weight", (z,))
        expect(lw("routed_expert_up_proj.weight"), "routed_expert_up_proj.weight", (d, z))
    return (x,)


def _expect_mxfp4_experts(ins, e: int, z) -> None:
    """Packed E2M1 payload u8 [E, out, in/2] and E8M0 scales u8 [E, out, in/32] per stack (k3c.quant layout)."""
    u8 = frozenset({"u8"})
    w1 = ins["experts.w1.weight_packed"]
    expect(w1, "experts.w1.weight_packed", (e, None, None), u8)
    m = w1.shape[1]
    for w, (rows, cols) in (("w1", (m, z)), ("w3", (m, z)), ("w2", (z, m))):
        half = cols // 2 if isinstance(cols, int) else None
        blocks = cols // 32 if isinstance(cols, int) else None
        require(not isinstance(cols, int) or cols % 32 == 0,
                f"experts.{w}: reduction dimension {cols} is not a multiple of the MXFP4 block 32")
        expect(ins[f"experts.{w}.weight_packed"], f"experts.{w}.weight_packed", (e, rows, half), u8)
        expect(ins[f"experts.{w}.weight_scale"], f"experts.{w}.weight_scale", (e, rows, blocks), u8)


MOE = OpDef("moe", moe_roles, {
    "layer": AttrSpec("int"),
    "num_experts": AttrSpec("int"),
    "top_k": AttrSpec("int"),
    "num_shared_experts": AttrSpec("int"),
    "router_activation": AttrSpec("str", choices=("sigmoid", "softmax")),
    "router_bias": AttrSpec("bool", doc="e_score_correction_bias, added for top-k selection only"),
    "renormalize": AttrSpec("bool"),
    "routed_scaling_factor": AttrSpec("float"),
    "latent_dim": AttrSpec("int", nullable=True, doc="LatentMoE width; none: experts at hidden width"),
    "latent_norm": AttrSpec("bool"),
    "norm_eps": AttrSpec("float", doc="eps of the latent RMSNorm"),
    "ep_rank": AttrSpec("int", required=False, doc="expert-parallel rank (shard pass); absent = 0"),
    "ep_size": AttrSpec("int", required=False, doc="expert-parallel ranks: the experts.* params hold experts "
                                                   "[ep_rank E/ep_size, (ep_rank+1) E/ep_size); absent = 1"),
    "expert_tp": AttrSpec("int", required=False,
                          doc="split experts (shard pass, EP 1): the experts.* params hold 1/expert_tp of every "
                          "expert's intermediate dim; the routed combine is all-reduced over TP; absent = 1"),
    "expert_format": AttrSpec("str", required=False, choices=("bf16", "mxfp4"),
                              doc="routed expert weights: bf16 stacks (absent = bf16) or MXFP4 packed + scales"),
    "mxfp4_linears": AttrSpec("strs", required=False,
                              doc="dense linears (roles of MOE_DENSE_LINEARS) held MXFP4 packed + scales"),
    "act_format": MX_ATTRS["act_format"],
    **ACT_ATTRS,
}, _infer_moe, _check_moe, doc="(latent) mixture of experts with shared experts (K3.md section 5)")


# ---- Block AttnRes mix -----------------------------------------------------------------------------------
def attn_res_roles(attrs: Mapping[str, Any]) -> tuple[Role, ...]:
    n = attrs.get("num_sources", 0)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
    return tuple(Role(f"source.{i}") for i in range(n)) + (Role("proj_weight", param=True),
                                                            Role("norm_weight", param=True))


def _check_attn_res(attrs):
    n, b = attrs.get("num_sources"), attrs.get("block")
    if n is not None and n < 1:
        raise TypeCheck(f"attn_res_mix needs >= 1 source, got num_sources = {n}")
    if n is not None and b is not None and not (1 <= b <= n <= b + 1):
        raise TypeCheck(f"block {b} does not fit num_sources {n}: the sources are the {b} completed blocks "
                        "b_0..b_{block-1}, optionally followed by the partial sum")


def _infer_attn_res(attrs, ins):
    sources = [r for r in ins if r.startswith("source.")]
    require(bool(sources), "attn_res_mix needs >= 1 source")
    first = ins[sources[0]]
    x, d = activation(ins, sources[0])
    for s in sources[1:]:
        if ins[s] != first:
            raise TypeCheck(f"{s}: expected {first} (as source.0), got {ins[s]}")
    expect(ins["proj_weight"], "proj_weight", (d,))
    expect(ins["norm_weight"], "norm_weight", (d,))
    return (x,)


ATTN_RES_MIX = OpDef("attn_res_mix", attn_res_roles, {
    "num_sources": AttrSpec("int"),
    "block": AttrSpec("int", doc="n: sources[:n] are the completed blocks b_0..b_{n-1}; a further one is the "
                                 "partial sum of block n"),
    "sublayer": AttrSpec("str", choices=("attn", "mlp", "out")),
    "eps": AttrSpec("float", doc="rms(v) = sqrt(mean(v^2) + eps); scores in f32"),
}, _infer_attn_res, _check_attn_res,
    doc="h = sum_i softmax_i((w * norm_gain) . v_i / rms(v_i)) v_i over the sources (K3.md section 4)")

OP_DEFS = (KDA, MLA, MLP, MOE, ATTN_RES_MIX)
