"""moe-lower: every `moe` layer op -> router GEMM, routing kernel, grouped expert GEMMs, combine, latent projections
and the shared experts (K3.md section 5).

    %y = moe(x, gate.weight, bias, experts..., shared..., down, norm, up)
 -> %lg = moe_linear(x, gate.weight) {proj="router", out_f32}            fp32 logits [..., E]
    %w, %ids, %off, %perm = moe_route(lg, bias)                             top-k, offsets, stable slot permutation
    %z = moe_linear(x, routed_expert_down_proj.weight) {proj="latent_down"} (LatentMoE; else z = x)
    %h = moe_gate_up(z, off, perm, experts.w1, experts.w3)                  grouped, GLU epilogue, permuted rows
    %o = moe_down(h, off, perm, experts.w2)                                 grouped, rows back in slot order
    %s = mlp(x, shared_experts.*)                                            shared experts (full width)
    %u = moe_combine(o, w, ids [, s])                                       weighted sum (+ shared when nothing sits
                                                                            between: non-latent, one EP rank)
    %u = all_reduce(u) {group="ep"}                                          ep_size > 1 only: partial -> full, before
                                                                            the latent norm ({group="tp"}: split
                                                                            experts, attr expert_tp)
    %n = rmsnorm(u, routed_expert_norm.weight)                               (latent_norm)
    %y = moe_linear(n, routed_expert_up_proj.weight, s) {proj="latent_up", residual}
With expert parallelism (attrs ep_rank / ep_size from the shard pass) the expert stacks hold this rank's experts and
routing still runs over all of them; a non-latent layer adds the shared experts after the all_reduce (`add`).
Dense linears the mxfp4 pass packed (attr mxfp4_linears: shared experts, latent projections) become moe_linear / mlp
ops with weight_format "mxfp4" (+ act_format) reading the packed pairs (the dense MXFP4 GEMM).
MXFP4 experts (expert_format "mxfp4", the mxfp4 pass) get mx = "auto" and the module's activation_format: the target
the kernels are emitted or run for decides (k3c.codegen.kernels.moe.mx_mode): natively through tl.dot_scaled with the
activations quantized to MXFP8 (e4m3) on targets with MX matrix units (mi355x, b200), upcast in registers elsewhere
(h200, mi300x, and wherever the activations stay bf16).
On targets whose expert layout is "hopper" (h100, h200: Target.expert_layout) the upcast grouped GEMMs of MXFP4
experts get expert_layout "hopper" (weight preparation rearranges those stacks; the hopper form reads them) where
the stacks' shapes allow it (N a multiple of 16, K of 64).
Counts: `moe_layers`, `latent`, `shared`, `mxfp4`, `mxfp4_linears`, `all_reduce`, `hopper_layout`.
"""
from __future__ import annotations

from ..ir.builder import Builder
from ..ir.core import Module
from ..ir.mxfp4_weights import PACKED_PARTS, packed_name
from ..ir.ops import bind_inputs
from .registry import PassContext, register_pass

_ACT_KEYS = ("activation", "situ_beta_gate", "situ_beta_up")


def _hopper_layout(module: Module, w: dict, target, act_format: str) -> bool:
    """Whether a layer's MXFP4 expert stacks take the hopper layout: the target's choice (Target.expert_layout) where
    its GEMMs upcast (no MX matrix units, or bf16 activations) and every stack has N a multiple of 16 and K of 64."""
    from ..codegen.kernels.moe import mx_mode
    from ..codegen.kernels.moe_hopper import HOPPER_K, HOPPER_ROWS

    if target is None or target.expert_layout != "hopper" or mx_mode("mxfp4", target, act_format) != "upcast":
        return False
    for name in ("w1", "w3", "w2"):
        shape = module.type_of(w[f"experts.{name}.weight_packed"]).shape
        if not all(isinstance(d, int) for d in shape[-2:]) or shape[-2] % HOPPER_ROWS or (2 * shape[-1]) % HOPPER_K:
            return False
    return True


@register_pass("moe-lower")
def moe_lower(module: Module, ctx: PassContext) -> Module:
    """MoE layers -> routing + grouped expert GEMM kernels + combine (+ latent projections, shared experts)."""
    if not any(op.op == "moe" for op in module.ops):
        return module
    act_format = module.attr_dict.get("activation_format", "bf16")
    if act_format not in ("bf16", "mxfp8", "mxfp4"):
        act_format = "bf16"
    b = Builder.like(module)
    rename: dict[str, str] = {}
    for op in ctx.walk(module.ops):
        if op.op != "moe":
            b.append(op.replace(inputs=tuple(rename.get(v, v) for v in op.inputs)) if rename else op)
            continue
        a = op.attr_dict
        w = bind_inputs("moe", a, [rename.get(v, v) for v in op.inputs])
        x, loc = w["x"], op.loc
        layer = {"layer": a["layer"]}
        ep_rank, ep_size = a.get("ep_rank", 0), a.get("ep_size", 1)
        expert_tp = a.get("expert_tp", 1)           # split experts: each rank's combine is a partial sum over TP
        ep = {"ep_rank": ep_rank, "ep_size": ep_size} if ep_size > 1 else {}
        fmt = a.get("expert_format", "bf16")
        act = {k: a[k] for k in _ACT_KEYS if k in a}
        latent = a["latent_dim"] is not None
        lin = a.get("mxfp4_linears", ()) or ()
        mx_lin = {"weight_format": "mxfp4", "act_format": act_format}

        def dense(role):
            """(inputs, attrs) of a dense linear role: the float weight, or its MXFP4 pair (mxfp4 pass)."""
            if role in lin:
                return [w[packed_name(role, p)] for p in PACKED_PARTS], mx_lin
            return [w[role]], {}

        logits = b.op("moe_linear", [x, w["gate.weight"]], {**layer, "proj": "router", "out_f32": True}, loc,
                      prefix="m")
        route_in = [logits] + ([w["gate.e_score_correction_bias"]] if a["router_bias"] else [])
        res = tuple(b.fresh("m") for _ in range(4))
        route_attrs = {**layer, "num_experts": a["num_experts"], "top_k": a["top_k"],
                       "router_activation": a["router_activation"], "router_bias": a["router_bias"],
                       "renormalize": a["renormalize"], "routed_scaling_factor": a["routed_scaling_factor"], **ep}
        b.append(b.make("moe_route", route_in, route_attrs, loc, results=res))
        weights, ids, off, perm = res
        if latent:
            dw, da = dense("routed_expert_down_proj.weight")
            z = b.op("moe_linear", [x, *dw], {**layer, "proj": "latent_down", **da}, loc, prefix="m")
        else:
            z = x
        grouped = {**layer, "num_experts": a["num_experts"], "top_k": a["top_k"], "expert_format": fmt,
                   "mx": "auto" if fmt == "mxfp4" else "none", **ep}
        if fmt == "mxfp4":
            grouped["act_format"] = act_format
            if _hopper_layout(module, w, ctx.target, act_format):
                grouped["expert_layout"] = "hopper"
                ctx.count("hopper_layout")

        def experts(*names):
            if fmt == "mxfp4":
                return [w[f"experts.{n}.{p}"] for n in names for p in ("weight_packed", "weight_scale")]
            return [w[f"experts.{n}"] for n in names]

        h = b.op("moe_gate_up", [z, off, perm, *experts("w1", "w3")], {**grouped, **act}, loc, prefix="m")
        o = b.op("moe_down", [h, off, perm, *experts("w2")], grouped, loc, prefix="m")
        shared = None
        if a["num_shared_experts"] > 0:
            sw = [t for p in ("gate", "up", "down") for t in dense(f"shared_experts.{p}_proj.weight")[0]]
            sa = mx_lin if "shared_experts.gate_proj.weight" in lin else {}
            shared = b.op("mlp", [x] + sw, {**layer, **act, **sa}, loc, prefix="m")
            ctx.count("shared")
        fuse_shared = shared is not None and not latent and ep_size == 1 and expert_tp == 1
        comb = {**layer, "num_experts": a["num_experts"], "top_k": a["top_k"], **ep}
        if fuse_shared:
            comb["residual"] = True
        u = b.op("moe_combine", [o, weights, ids] + ([shared] if fuse_shared else []), comb, loc, prefix="m")
        if ep_size > 1 or expert_tp > 1:
            group, size = ("ep", ep_size) if ep_size > 1 else ("tp", expert_tp)
            u = b.op("all_reduce", [u], {**layer, "group": group, "size": size}, loc, prefix="m")
            ctx.count("all_reduce")
        if latent:
            ctx.count("latent")
            if a["latent_norm"]:
                u = b.op("rmsnorm", [u, w["routed_expert_norm.weight"]], {**layer, "eps": a["norm_eps"]}, loc,
                         prefix="m")
            uw, ua = dense("routed_expert_up_proj.weight")
            up = {**layer, "proj": "latent_up", **ua}
            if shared is not None:
                up["residual"] = True
            out = b.op("moe_linear", [u, *uw] + ([shared] if shared else []), up, loc, prefix="m")
        elif shared is not None and not fuse_shared:
            out = b.op("add", [u, shared], layer, loc, prefix="m")
        else:
            out = u
        rename[op.results[0]] = out
        ctx.count("moe_layers")
        if fmt == "mxfp4":
            ctx.count("mxfp4")
        if lin:
            ctx.count("mxfp4_linears", len(lin))
    outputs = tuple(rename.get(v, v) for v in module.outputs)
    return b.build(outputs)
