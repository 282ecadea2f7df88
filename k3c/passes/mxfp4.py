"""mxfp4: the weights the spec's `quantization:` section selects become MXFP4 (K3.md section 6), a weight transform
recorded in the IR: each selected stacked expert param P [E, out, in] (bf16) is replaced by

    %p = param {name="P.weight_packed", quant="mxfp4", rule=..., source="P"}   u8[E, out, in/2]   E2M1 pairs
    %s = param {name="P.weight_scale",  quant="mxfp4", rule=..., source="P"}   u8[E, out, in/32]  E8M0 scales

(k3c.quant.mxfp4_quantize's layout along the last = reduction dimension), and the `moe` op reading them gets
`expert_format = "mxfp4"`. The tensors themselves are made once at load (k3c/runtime/weight_prep.py) or come
packed from a checkpoint (`k3c quantize`, K3's compressed-tensors experts).

The selection comes from module attrs set by the frontend (quant_format, quant_rule, quant_include,
quant_exclude); without them the pass changes nothing. A layer's three stacks are quantized together or not at all
(one `expert_format` per op). Counts: `moe_layers`, `params`.
"""
from __future__ import annotations

from ..errors import IRError
from ..frontend.quant_check import BLOCK, select
from ..ir.builder import Builder
from ..ir.core import Module, TensorType
from ..ir.ops import get_op_def
from .registry import PassContext, register_pass

STACKS = ("experts.w1", "experts.w3", "experts.w2")
PARTS = ("weight_packed", "weight_scale")


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
    """Selected routed expert stacks -> packed MXFP4 params (payload + E8M0 scales); moe ops read them."""
    if module.attr("quant_format", None) != "mxfp4":
        return module
    rule = module.attr("quant_rule", "floor")
    include, exclude = module.attr("quant_include", ()), module.attr("quant_exclude", ())
    params = module.params()
    chosen = set(select(list(params), include, exclude))
    if not chosen:
        return module

    # which moe ops get packed experts; everything else that reads a chosen weight is an error (nothing but the
    # moe op can read the packed form yet)
    packed_ops: dict[str, dict[str, str]] = {}          # moe op name -> role -> param name
    for op in module.ops:
        if op.op == "moe" and op.attr("expert_format", "bf16") == "bf16":
            roles = dict(zip((r.name for r in get_op_def("moe").roles(op.attr_dict)), op.inputs))
            names = {r: module.defs[roles[r]].attr("name") for r in STACKS if module.defs[roles[r]].op == "param"}
            hit = [r for r in STACKS if names.get(r) in chosen]
            if hit and len(hit) < 3:
                raise IRError(f"the quantization patterns select {', '.join(names[r] for r in hit)} but not the "
                              f"layer's other expert stacks; quantize a layer's w1, w3 and w2 together",
                              op=op.describe(), loc=op.loc or None, pass_name="mxfp4")
            if hit:
                packed_ops[op.name] = names
    stacked = {n for names in packed_ops.values() for n in names.values()}
    for name in sorted(chosen - stacked):
        op = params[name]
        raise IRError(f"weight '{name}' is selected for MXFP4 but is not a routed expert stack of a moe op; k3c "
                      f"quantizes routed experts only", op=op.describe(), loc=op.loc or None, pass_name="mxfp4")

    b = Builder.like(module)
    new_params: dict[str, tuple[str, str]] = {}         # source weight -> (packed value, scale value)
    for op in ctx.walk(module.ops):
        if op.op == "param" and op.attr("name") in stacked:
            name = op.attr("name")
            tp, ts = packed_types(op.types[0], name)
            vals = []
            for part, ty in zip(PARTS, (tp, ts)):
                attrs = {"name": f"{name}.{part}", "quant": "mxfp4", "rule": rule, "source": name}
                vals.append(b.declare("param", ty, attrs, op.loc, prefix="w"))
            new_params[op.results[0]] = (vals[0], vals[1])
            ctx.count("params")
            continue
        if op.op == "moe" and op.name in packed_ops:
            a = dict(op.attr_dict, expert_format="mxfp4")
            roles = [r.name for r in get_op_def("moe").roles(op.attr_dict)]
            by_role = dict(zip(roles, op.inputs))
            for r in STACKS:
                packed, scale = new_params[by_role.pop(r)]
                by_role[f"{r}.weight_packed"], by_role[f"{r}.weight_scale"] = packed, scale
            ins = [by_role[r.name] for r in get_op_def("moe").roles(a)]
            b.append(b.make("moe", ins, a, op.loc, results=op.results))
            ctx.count("moe_layers")
            continue
        b.append(op)
    return b.build(module.outputs)
