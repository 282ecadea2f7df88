"""Spec -> IR: the whole prefill forward (input ids [B, T] -> logits [B, T, vocab]) as layer-level ops.

With AttnRes the decoder follows K3.md section 4 literally: an explicit list of completed blocks and a partial sum,
`add` ops for the partial sums, `attn_res_mix` ops over the completed blocks plus the partial, and a final mix for
the output. Without it, the ordinary pre-norm residual stream. Every op's loc is the YAML field it comes from.

Weights come from the canonical table (k3c/frontend/weight_names.py) in the order of the consuming op's roles, each
`param` emitted right before its first use. One weight of the table is never read: layer 0's
`self_attention_res.*` (with no completed block yet, h = the embedding), so it gets no param op.
"""
from __future__ import annotations

import re

from ..ir.builder import Builder
from ..ir.core import Module, TensorType
from ..ir.ops import get_op_def
from .spec import ModelSpec
from .weight_names import weight_table

PARAM_DTYPES = {"float": "bf16", "fp32": "f32"}
L2NORM_EPS = 1e-6          # KDA q/k L2 norm (K3.md section 2)
LORA_NORM_EPS = 1e-6       # MLA q_a / kv_a RMSNorms (K3.md section 3)

# Which YAML field a weight comes from, per consuming op and role; other roles point at the op's section.
_PARAM_FIELDS = {
    "kda": {"q_conv1d.weight": "kda.conv_kernel", "k_conv1d.weight": "kda.conv_kernel",
            "v_conv1d.weight": "kda.conv_kernel", "f_a_proj.weight": "kda.gate_rank",
            "f_b_proj.weight": "kda.gate_rank", "A_log": "kda.gate", "dt_bias": "kda.gate",
            "g_proj.weight": "kda.output_gate", "g_a_proj.weight": "kda.output_gate_rank",
            "g_b_proj.weight": "kda.output_gate_rank", "o_norm.weight": "kda.head_dim"},
    "mla": {"q_proj.weight": "mla.q_lora_rank", "q_a_proj.weight": "mla.q_lora_rank",
            "q_a_layernorm.weight": "mla.q_lora_rank", "q_b_proj.weight": "mla.q_lora_rank",
            "kv_a_proj_with_mqa.weight": "mla.kv_lora_rank", "kv_a_layernorm.weight": "mla.kv_lora_rank",
            "kv_b_proj.weight": "mla.kv_lora_rank", "g_proj.weight": "mla.output_gate"},
    "mlp": {},
    "moe": {"gate.weight": "moe.num_experts", "gate.e_score_correction_bias": "moe.router_bias",
            "experts.w1": "moe.expert_intermediate_size", "experts.w3": "moe.expert_intermediate_size",
            "experts.w2": "moe.expert_intermediate_size",
            "shared_experts.gate_proj.weight": "moe.num_shared_experts",
            "shared_experts.up_proj.weight": "moe.num_shared_experts",
            "shared_experts.down_proj.weight": "moe.num_shared_experts",
            "routed_expert_down_proj.weight": "moe.latent_dim", "routed_expert_norm.weight": "moe.latent_norm",
            "routed_expert_up_proj.weight": "moe.latent_dim"},
    "attn_res_mix": {},
}
_OP_FIELDS = {"kda": "kda", "mla": "mla", "mlp": "mlp.dense_intermediate_size", "moe": "moe",
              "attn_res_mix": "attn_res.block_size", "rmsnorm": "model.rms_norm_eps"}


def spec_to_module(spec: ModelSpec) -> Module:
    """Lower a validated ModelSpec to a verified-clean layer-level IR Module."""
    return _Lowering(spec).run()


def module_attrs(spec: ModelSpec) -> dict:
    """Model-wide facts passes need without the spec (dtype, precision plan, AttnRes block size)."""
    w = spec.precision.weights
    return {
        "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size, "num_layers": spec.num_layers,
        "layer_kinds": spec.layer_kinds, "rms_norm_eps": float(spec.rms_norm_eps), "max_context": spec.max_context,
        "dtype": "bf16", "attn_res_block_size": spec.attn_res.block_size if spec.attn_res else None,
        "weight_format": w.format, "mxfp4_include": w.include, "mxfp4_exclude": w.exclude,
        "mxfp4_scale_rule": w.scale_rule, "activation_format": spec.precision.activations,
        **quantization_attrs(spec),
    }


def quantization_attrs(spec: ModelSpec) -> dict:
    """The `quantization:` section as module attrs, read by the `mxfp4` pass (none without the section, so the
    IR of an unquantized spec is unchanged)."""
    q = spec.quantization
    if q is None:
        return {}
    return {"quant_format": q.format, "quant_rule": q.rule, "quant_include": q.include, "quant_exclude": q.exclude}


class _Lowering:
    def __init__(self, spec: ModelSpec):
        self.spec = spec
        # spec names are validated by the schema; an imported one may hold other characters
        name = re.sub(r"[^A-Za-z0-9_.\-]", "_", spec.name) or "model"
        self.b = Builder(name if name[0] not in ".-" else "_" + name, module_attrs(spec))
        self.table = weight_table(spec)
        self.params: dict[str, str] = {}
        self.eps = float(spec.rms_norm_eps)

    # -- pieces --------------------------------------------------------------------------------------------
    def loc(self, field: str) -> str:
        return self.spec.loc(field)

    def param(self, name: str, field: str) -> str:
        if name not in self.params:
            info = self.table[name]      # a KeyError here means the registry roles and weight_names disagree
            ty = TensorType(PARAM_DTYPES[info.dtype], info.shape)
            self.params[name] = self.b.declare("param", ty, {"name": name}, self.loc(field), prefix="w")
        return self.params[name]

    def layer_op(self, opname: str, data: list[str], attrs: dict, prefix: str, out: str) -> str:
        """An op whose leading roles are `data` and whose weight roles are `prefix` + role."""
        roles = get_op_def(opname).roles(attrs)
        fields, section = _PARAM_FIELDS.get(opname, {}), _OP_FIELDS.get(opname, opname)
        weights = [self.param(prefix + r.name, fields.get(r.name, section)) for r in roles[len(data):]]
        return self.b.op(opname, data + weights, attrs, self.loc(section), prefix=out)

    def norm(self, x: str, weight: str, layer: int | None) -> str:
        attrs = {"eps": self.eps} if layer is None else {"eps": self.eps, "layer": layer}
        w = self.param(weight, "model.rms_norm_eps")
        return self.b.op("rmsnorm", [x, w], attrs, self.loc("model.rms_norm_eps"), prefix="x")

    def add(self, a: str, b: str, layer: int, out: str) -> str:
        field = "attn_res" if self.spec.attn_res else "layers"
        return self.b.op("add", [a, b], {"layer": layer}, self.loc(field), prefix=out)

    def attention(self, layer: int, x: str) -> str:
        s = self.spec
        if s.layer_kinds[layer] == "kda":
            k = s.kda
            attrs = {"layer": layer, "num_heads": k.num_heads, "head_dim": k.head_dim, "conv_kernel": k.conv_kernel,
                     "gate": k.gate, "gate_lower_bound": float(k.gate_lower_bound), "output_gate": k.output_gate,
                     "norm_eps": self.eps, "l2norm_eps": L2NORM_EPS}
            return self.layer_op("kda", [x], attrs, f"layers.{layer}.self_attn.", "a")
        m = s.mla
        attrs = {"layer": layer, "num_heads": m.num_heads, "q_lora_rank": m.q_lora_rank,
                 "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
                 "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "rope": m.rope,
                 "output_gate": m.output_gate, "lora_norm_eps": LORA_NORM_EPS, "causal": True}
        return self.layer_op("mla", [x], attrs, f"layers.{layer}.self_attn.", "a")

    def activation_attrs(self) -> dict:
        act = self.spec.mlp.activation
        if act.kind == "situ":
            return {"activation": "situ", "situ_beta_gate": float(act.situ_beta_gate),
                    "situ_beta_up": float(act.situ_beta_up)}
        return {"activation": act.kind}

    def ffn(self, layer: int, x: str) -> str:
        s = self.spec
        if not s.is_moe_layer(layer):
            attrs = {"layer": layer, **self.activation_attrs()}
            return self.layer_op("mlp", [x], attrs, f"layers.{layer}.mlp.", "f")
        e = s.mlp.moe
        attrs = {"layer": layer, "num_experts": e.num_experts, "top_k": e.top_k,
                 "num_shared_experts": e.num_shared_experts, "router_activation": e.router_activation,
                 "router_bias": e.router_bias, "renormalize": e.renormalize,
                 "routed_scaling_factor": float(e.routed_scaling_factor), "latent_dim": e.latent_dim,
                 "latent_norm": e.latent_norm, "norm_eps": self.eps, **self.activation_attrs()}
        return self.layer_op("moe", [x], attrs, f"layers.{layer}.block_sparse_moe.", "f")

    def mix(self, blocks: list[str], partial: str, *, complete: bool, sublayer: str, prefix: str,
            layer: int | None) -> str:
        """attn_res_mix over blocks + [partial]; `complete`: the partial is itself a finished block."""
        sources = blocks + [partial]
        attrs = {"num_sources": len(sources), "block": len(sources) if complete else len(blocks),
                 "sublayer": sublayer, "eps": self.eps}
        if layer is not None:
            attrs["layer"] = layer
        return self.layer_op("attn_res_mix", sources, attrs, prefix, "h")

    # -- decoders ------------------------------------------------------------------------------------------
    def attn_res_decoder(self, emb: str) -> str:
        """K3.md section 4, line by line."""
        size = self.spec.attn_res.block_size
        partial: str | None = emb
        blocks: list[str] = []
        for l in range(self.spec.num_layers):
            p = f"layers.{l}."
            starts = l % size == 0
            if blocks:
                h = self.mix(blocks, partial, complete=starts, sublayer="attn", prefix=p + "self_attention_res.",
                             layer=l)
            else:
                h = partial                  # no completed block yet: h = partial (the embedding)
            if starts:
                blocks.append(partial)
                partial = None
            y = self.attention(l, self.norm(h, p + "input_layernorm.weight", l))
            partial = y if partial is None else self.add(partial, y, l, "p")
            h = self.mix(blocks, partial, complete=False, sublayer="mlp", prefix=p + "mlp_res.", layer=l)
            partial = self.add(partial, self.ffn(l, self.norm(h, p + "post_attention_layernorm.weight", l)), l, "p")
        return self.mix(blocks, partial, complete=False, sublayer="out", prefix="output_attn_res.", layer=None)

    def residual_decoder(self, h: str) -> str:
        for l in range(self.spec.num_layers):
            p = f"layers.{l}."
            h = self.add(h, self.attention(l, self.norm(h, p + "input_layernorm.weight", l)), l, "r")
            h = self.add(h, self.ffn(l, self.norm(h, p + "post_attention_layernorm.weight", l)), l, "r")
        return h

    def run(self) -> Module:
        s, b = self.spec, self.b
        ids = b.declare("input", TensorType("i64", ("B", "T")), {"name": "input_ids"}, self.loc("model"),
                        name="input_ids")
        emb = b.op("embedding", [ids, self.param("embed_tokens.weight", "model.vocab_size")], {},
                   self.loc("model.vocab_size"), prefix="emb")
        out = self.attn_res_decoder(emb) if s.attn_res else self.residual_decoder(emb)
        x = self.norm(out, "norm.weight", None)
        tied = s.tie_word_embeddings
        head = "embed_tokens.weight" if tied else "lm_head.weight"
        field = "model.tie_word_embeddings" if tied else "model.vocab_size"
        logits = b.op("lm_head", [x, self.param(head, field)], {"tied": tied}, self.loc(field), name="logits")
        return b.build([logits])
