"""mla-absorb: every `mla` layer op -> the weight transforms splitting W_kvb, and `mla_absorbed`, the MLA sublayer
over its layer's paged latent cache (MQA mode for decode / short appends, MHA mode for prefill, per call by the
cost model; K3.md section 3).

    %a = mla(x, q..., kv_a_proj_with_mqa.weight, kv_a_layernorm.weight, kv_b_proj.weight, g_proj.weight, o_proj.weight)
 -> %uk = mla_kvb_split(kv_b_proj.weight) {part="uk_t"}       W_UK_T [N, P, L]   (once, when weights load)
    %uv = mla_kvb_split(kv_b_proj.weight) {part="uv"}         W_UV   [N, L, V]
    %a  = mla_absorbed(x, q..., kv_a_proj_with_mqa.weight, kv_a_layernorm.weight, %uk, g_proj.weight, %uv,
                       o_proj.weight) {mode="auto", prefill_chunk=...}

W_UV stays apart from o_proj: in K3's gated MLA the output gate multiplies o = o_lat W_UV per head and channel
between the two. Counts: `mla_layers`, `kvb_split`.
"""
from __future__ import annotations

from ..ir.builder import Builder
from ..ir.core import Module
from ..ir.mla_ops import absorbed_roles
from ..ir.ops import bind
from .registry import PassContext, register_pass

# MHA mode expands K/V for this many context tokens at a time (8192 x 96 heads x 256 x bf16 = 400 MB at K3 shapes)
PREFILL_CHUNK = 8192


@register_pass("mla-absorb")
def mla_absorb(module: Module, ctx: PassContext) -> Module:
    """MLA layers -> W_kvb split (weight transform) + the absorbed/expanded sublayer over the paged latent cache."""
    if not any(op.op == "mla" for op in module.ops):
        return module
    b = Builder.like(module)
    for op in ctx.walk(module.ops):
        if op.op != "mla":
            b.append(op)
            continue
        a = op.attr_dict
        w = bind(op)
        common = {"layer": a["layer"], "num_heads": a["num_heads"], "qk_nope_head_dim": a["qk_nope_head_dim"],
                  "v_head_dim": a["v_head_dim"], "kv_lora_rank": a["kv_lora_rank"]}
        uk = b.op("mla_kvb_split", [w["kv_b_proj.weight"]], {**common, "part": "uk_t"}, op.loc, prefix="w")
        uv = b.op("mla_kvb_split", [w["kv_b_proj.weight"]], {**common, "part": "uv"}, op.loc, prefix="w")
        ctx.count("kvb_split", 2)
        attrs = {**a, "mode": "auto", "prefill_chunk": PREFILL_CHUNK}
        w.update({"w_uk_t": uk, "w_uv": uv})
        ins = [w[r.name] for r in absorbed_roles(attrs)]
        b.append(b.make("mla_absorbed", ins, attrs, op.loc, results=op.results))
        ctx.count("mla_layers")
    return b.build(module.outputs)
