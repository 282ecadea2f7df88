"""mxfp4: the weights the spec's `quantization:` section selects become MXFP4 (K3.md section 6), a weight transform
recorded in the IR: each selected weight P (a stacked expert param [E, out, in] or a linear [out, in], bf16) is
replaced by

    %p = param {name=packed_name(P, "weight_packed"), quant="mxfp4", rule=..., source="P"}   u8[..., out, in/2]
    %s = param {name=packed_name(P, "weight_scale"),  quant="mxfp4", rule=..., source="P"}   u8[..., out, in/32]

(k3c.quant.mxfp4_quantize's layout along the last = reduction dimension; `experts.w1` -> `experts.w1.weight_packed`,
`lm_head.weight` -> `lm_head.weight_packed` as compressed-tensors names a Linear's), and the op reading them is
marked: `moe` gets `expert_format = "mxfp4"` (routed experts) and / or `mxfp4_linears` (its shared experts and latent
projections, by role), `lm_head` and `mlp` get `weight_format = "mxfp4"` (+ `act_format`, the module's activation
format). The tensors themselves are made once at load (k3c/runtime/weight_prep.py) or come packed from a checkpoint
(`k3c quantize`, K3's compressed-tensors experts).

The selection comes from module attrs set by the frontend (quant_format, quant_rule, quant_include,
quant_exclude); without them the pass changes nothing. A layer's three expert stacks are quantized together or not
at all (one `expert_format` per op), and so are the gate/up/down weights of an MLP or of the shared experts. A
weight read by any other op (attention kernels, the router, the embedding) is an error. Counts: `moe_layers`,
`params`, `linear_ops`.
"""
from __future__ import annotations

from ..errors import IRError
from ..frontend.quant_check import BLOCK, select
from ..ir.builder import Builder
from ..ir.core import Module, TensorType
from ..ir.layer_ops import MLP_WEIGHTS, MOE_DENSE_LINEARS
from ..ir.mxfp4_weights import PACKED_PARTS, is_mxfp4, packed_name
from ..ir.ops import bind, get_op_def
from .registry import PassContext, register_pass

STACKS = ("experts.w1", "experts.w3", "experts.w2")


def packed_types(ty: TensorType, name: str) -> tuple[TensorType, TensorType]:
    """u8 payload and scale types of a weight [..., K] quantized along K."""
    k = ty.shape[-1] if ty.shape else None
    if not isinstance(k, int) or k % BLOCK:
        raise IRError(f"weight '{name}' {ty}: the reduction (last) dimension must be a multiple of the MXFP4 block "
                      f"{BLOCK}")
    lead = tuple(ty.shape[:-1])
    return TensorType("u8", lead + (k // 2,)), TensorType("u8", lead + (k // BLOCK,))


@register_pass("mxfp4")
def mxfp4(module: Module, ctx: PassContext) -> Module:
    """Selected expert stacks and linears -> packed MXFP4 params (payload + E8M0 scales); their ops read them."""
    if module.attr("quant_format", None) != "mxfp4":
        return module
    include, exclude = module.attr("quant_include", ()), module.attr("quant_exclude", ())
    params = module.params()
    # (already packed params are not selected again: the pass is idempotent)
    chosen = set(select([n for n, op in params.items() if op.attr("quant", None) is None], include, exclude))
    if not chosen:
        return module
    expert_ops = _expert_ops(module, chosen)
    stacked = {n for names in expert_ops.values() for n in names.values()}
    linear_ops, dense = _linear_ops(module, chosen)
    for name in sorted(chosen - stacked - dense):
        op = params[name]
        raise IRError(f"weight '{name}' is selected for MXFP4 but no op reads it as a plain GEMM operand; k3c "
                      f"quantizes routed experts only, plus lm_head, dense MLPs and the MoE layer's shared experts "
                      f"and latent projections", op=op.describe(), loc=op.loc or None, pass_name="mxfp4")
    return _pack(module, ctx, stacked | dense, expert_ops, linear_ops)


def _expert_ops(module: Module, chosen: set[str]) -> dict[str, dict[str, str]]:
    """moe op name -> role -> param name, for the moe ops whose expert stacks are chosen (all three or none)."""
    out: dict[str, dict[str, str]] = {}
    for op in module.ops:
        if op.op == "moe" and op.attr("expert_format", "bf16") == "bf16":
            roles = bind(op)
            names = {r: module.defs[roles[r]].attr("name") for r in STACKS if module.defs[roles[r]].op == "param"}
            hit = [r for r in STACKS if names.get(r) in chosen]
            if hit and len(hit) < 3:
                raise IRError(f"the quantization patterns select {', '.join(names[r] for r in hit)} but not the "
                              f"layer's other expert stacks; quantize a layer's w1, w3 and w2 together",
                              op=op.describe(), loc=op.loc or None, pass_name="mxfp4")
            if hit:
                out[op.name] = names
    return out


def _linear_ops(module: Module, chosen: set[str]) -> tuple[dict[str, tuple[str, ...]], set[str]]:
    """The dense linears chosen: lm_head (untied), mlp (gate/up/down together), the moe op's shared experts (together)
    and latent projections. (op name -> roles packed, the param names they read)."""
    out: dict[str, tuple[str, ...]] = {}
    dense: set[str] = set()
    for op in module.ops:
        if op.op not in ("lm_head", "mlp", "moe"):
            continue
        names = {r: module.defs[v].attr("name") for r, v in bind(op).items() if module.defs[v].op == "param"}
        if op.op == "lm_head":
            cand = () if op.attr("tied", False) or is_mxfp4(op.attr_dict) else ("lm_head.weight",)
        elif op.op == "mlp":
            cand = () if is_mxfp4(op.attr_dict) else MLP_WEIGHTS
        else:
            cand = tuple(r for r in MOE_DENSE_LINEARS if r in names)
        hit = tuple(r for r in cand if names.get(r) in chosen)
        if not hit:
            continue
        groups = [MLP_WEIGHTS] if op.op == "mlp" else [tuple(r for r in cand if r.startswith("shared_experts."))]
        for g in groups:
            got = [r for r in g if r in hit]
            if got and len(got) < len(g):
                raise IRError(f"the quantization patterns select {', '.join(names[r] for r in got)} but not "
                              f"{', '.join(names[r] for r in g if r not in hit)}; an MLP's gate_proj, up_proj and "
                              f"down_proj are quantized together", op=op.describe(), loc=op.loc or None,
                              pass_name="mxfp4")
        out[op.name] = hit
        dense.update(names[r] for r in hit)
    return out, dense


def _pack(module: Module, ctx: PassContext, packed: set[str], expert_ops: dict[str, dict[str, str]],
          linear_ops: dict[str, tuple[str, ...]]) -> Module:
    """The rewrite: each packed weight's param -> its two packed params; the ops reading them marked and rewired."""
    rule = module.attr("quant_rule", "floor")
    act = module.attr("activation_format", "bf16")
    act = act if act in ("bf16", "mxfp8", "mxfp4") else "bf16"
    b = Builder.like(module)
    new_params: dict[str, tuple[str, str]] = {}         # source weight value -> (packed value, scale value)
    for op in ctx.walk(module.ops):
        if op.op == "param" and op.attr("name") in packed:
            name = op.attr("name")
            tp, ts = packed_types(op.types[0], name)
            vals = []
            for part, ty in zip(PACKED_PARTS, (tp, ts)):
                attrs = {"name": packed_name(name, part), "quant": "mxfp4", "rule": rule, "source": name}
                if op.attr("shard", None):      # a slice of the shard pass: the packed slice splits the same dim
                    attrs["shard"] = op.attr("shard")
                vals.append(b.declare("param", ty, attrs, op.loc, prefix="w"))
            new_params[op.results[0]] = (vals[0], vals[1])
            ctx.count("params")
            continue
        if op.name not in expert_ops and op.name not in linear_ops:
            b.append(op)
            continue
        a = dict(op.attr_dict)
        packed_roles: list[str] = []
        if op.name in expert_ops:
            a["expert_format"] = "mxfp4"
            packed_roles += list(STACKS)
            ctx.count("moe_layers")
        if op.name in linear_ops:
            hit = linear_ops[op.name]
            if op.op == "moe":
                a["mxfp4_linears"] = tuple(hit)
            else:
                a["weight_format"], a["act_format"] = "mxfp4", act
            packed_roles += list(hit)
            ctx.count("linear_ops")
        by_role = bind(op)
        for r in packed_roles:
            src = new_params[by_role.pop(r)]
            for part, v in zip(PACKED_PARTS, src):
                by_role[packed_name(r, part)] = v
        ins = [by_role[r.name] for r in get_op_def(op.op).roles(a)]
        b.append(b.make(op.op, ins, a, op.loc, results=op.results))
    return b.build(module.outputs)
