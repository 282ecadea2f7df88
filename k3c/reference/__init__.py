"""Eager PyTorch semantics of every k3c op (K3.md): the numeric oracle every kernel and import is tested against.

Layer functions take `w`, that layer's weights with the prefix stripped (`w["q_proj.weight"]` for
`layers.{i}.self_attn.q_proj.weight`), and an already-normed input; see model.py for the cache layout.
"""
from .attnres import attn_res_logits, attn_res_merge, attn_res_mix, attn_res_partial, attn_res_query
from .kda import KDAState, kda_chunked, kda_gate, kda_layer, kda_recurrent, kda_zero_state, short_conv
from .mla import mla_attention, mla_latent, mla_layer, mla_query
from .model import ReferenceCache, ReferenceModel, reference_forward, strip_prefix
from .moe import glu_act, mlp, moe_layer, moe_layer_ep, route, routed_experts, routed_weights
from .norms import l2_norm, linear, rms_norm

__all__ = ["ReferenceModel", "ReferenceCache", "reference_forward", "strip_prefix",
           "KDAState", "kda_layer", "kda_recurrent", "kda_chunked", "kda_gate", "kda_zero_state", "short_conv",
           "mla_layer", "mla_attention", "mla_query", "mla_latent",
           "attn_res_mix", "attn_res_query", "attn_res_logits", "attn_res_partial", "attn_res_merge",
           "moe_layer", "moe_layer_ep", "route", "routed_experts", "routed_weights", "mlp", "glu_act",
           "rms_norm", "l2_norm", "linear"]
