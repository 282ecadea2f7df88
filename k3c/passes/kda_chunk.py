"""kda-chunk: every `kda` layer op -> its projections (kda_proj, dense GEMMs), the KDA core (kda_attn: fused input
prep + chunked UT/WY prefill / fused recurrent decode, fp32 state in the layer cache) and the output (kda_out:
per-head RMSNorm x sigmoid gate), then the o projection.

    %a = kda(x, q_proj.weight, ...)
 -> %q = kda_proj(x, q_proj.weight) ... %f = kda_proj(kda_proj(x, f_a_proj.weight), f_b_proj.weight)
    %o = kda_attn(q, k, v, f, b, q_conv1d.weight, k_conv1d.weight, v_conv1d.weight, A_log, dt_bias)
    %y = kda_out(o, gate, o_norm.weight);  %a = kda_proj(y, o_proj.weight)

The chunk step, V block and matmul precision of kda_attn come from the compile target (`ctx.target`, None = the
default compile target) through k3c.codegen.kernels.kda.kda_plan. Counts: `kda_layers`, `prep`, `chunk`,
`decode`, `out`, `proj`.
"""
from __future__ import annotations

from ..codegen.kernels.kda import kda_plan
from ..ir.builder import Builder
from ..codegen.kernels.common import IR_DTYPES
from ..ir.core import Module
from ..ir.kda_ops import ATTN_PARAMS
from ..ir.ops import bind_inputs
from .dce import eliminate_dead
from .registry import PassContext, register_pass

@register_pass("kda-chunk", ensures=("no-dead-ops",))
def kda_chunk(module: Module, ctx: PassContext) -> Module:
    """KDA layers -> projections + fused prep/chunked-prefill/recurrent-decode core + output norm x gate."""
    if not any(op.op == "kda" for op in module.ops):
        return module
    target = ctx.plan_target
    b = Builder.like(module)
    rename: dict[str, str] = {}
    for op in ctx.walk(module.ops):
        if op.op != "kda":
            b.append(op.replace(inputs=tuple(rename.get(v, v) for v in op.inputs)) if rename else op)
            continue
        a = op.attr_dict
        w = bind_inputs("kda", a, [rename.get(v, v) for v in op.inputs])
        x = w["x"]
        layer = a["layer"]
        loc = op.loc
        common = {"layer": layer}

        def proj(src: str, weight: str, name: str) -> str:
            ctx.count("proj")
            return b.op("kda_proj", [src, w[weight]], {**common, "proj": name}, loc, prefix="p")

        q, k, v = (proj(x, f"{p}_proj.weight", p) for p in "qkv")
        f = proj(proj(x, "f_a_proj.weight", "f_a"), "f_b_proj.weight", "f_b")
        beta = proj(x, "b_proj.weight", "b")
        if a["output_gate"] == "full_rank":
            gate = proj(x, "g_proj.weight", "g")
        else:
            gate = proj(proj(x, "g_a_proj.weight", "g_a"), "g_b_proj.weight", "g_b")
        xdt = IR_DTYPES.get(b.types[x].dtype, "bf16")
        plan = kda_plan(a["head_dim"], xdt, target)
        attn_attrs = {**common, "num_heads": a["num_heads"], "head_dim": a["head_dim"],
                      "conv_kernel": a["conv_kernel"], "gate": a["gate"], "gate_lower_bound": a["gate_lower_bound"],
                      "l2norm_eps": a["l2norm_eps"], "chunk": plan.chunk, "block_v": plan.block_v, "dot": plan.dot}
        o = b.op("kda_attn", [q, k, v, f, beta] + [w[p] for p in ATTN_PARAMS], attn_attrs, loc, prefix="o")
        y = b.op("kda_out", [o, gate, w["o_norm.weight"]],
                 {**common, "num_heads": a["num_heads"], "head_dim": a["head_dim"], "norm_eps": a["norm_eps"]},
                 loc, prefix="y")
        out = proj(y, "o_proj.weight", "o")
        rename[op.results[0]] = out
        for key in ("kda_layers", "prep", "chunk", "decode", "out"):
            ctx.count(key)
    outputs = tuple(rename.get(v, v) for v in module.outputs)
    result, _ = eliminate_dead(b.build(outputs))
    return result
