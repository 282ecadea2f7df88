"""The model interface and generic ops the frontend emits: input, param, add, rmsnorm, embedding, lm_head."""
from __future__ import annotations

from .core import INT_DTYPES, TensorType
from .mxfp4_weights import MX_ATTRS, is_mxfp4, linear_weight, packed_roles
from .opdef import AttrSpec, OpDef, Role, TypeCheck, activation, expect, fixed_roles, require, same_type

NAME_ATTR = {"name": AttrSpec("str", doc="model input / canonical weight name")}

INPUT = OpDef("input", fixed_roles(), NAME_ATTR, keep=True, pure=False,
              doc="a model input (e.g. token ids i64[B, T]); its type is declared")
# a weight a pass derived from another one (the `mxfp4` pass: `P.weight_packed` / `P.weight_scale` from `P`)
PARAM_ATTRS = {**NAME_ATTR,
               "quant": AttrSpec("str", required=False, choices=("mxfp4",), doc="quantized form of `source`"),
               "rule": AttrSpec("str", required=False, choices=("floor", "rceil"), doc="MX scale rule"),
               "source": AttrSpec("str", required=False, doc="the canonical weight it is derived from")}
PARAM = OpDef("param", fixed_roles(), PARAM_ATTRS,
              doc="a weight, named by its canonical weight name; its type is declared, no data in the IR")


def _infer_add(attrs, ins):
    return (same_type(ins, ("lhs", "rhs")),)


ADD = OpDef("add", fixed_roles("lhs", "rhs"), {}, _infer_add, doc="elementwise sum of two same-typed tensors")


def _infer_rmsnorm(attrs, ins):
    x, d = activation(ins)
    expect(ins["weight"], "weight", (d,))
    return (x,)


RMSNORM = OpDef("rmsnorm", fixed_roles("x", params=("weight",)), {"eps": AttrSpec("float")}, _infer_rmsnorm,
                doc="x / sqrt(mean(x^2) + eps) * weight over the last dim")


def _infer_embedding(attrs, ins):
    ids, w = ins["ids"], ins["embed_tokens.weight"]
    require(ids.dtype in INT_DTYPES, f"ids: expected an integer dtype, got {ids}")
    require(w.rank == 2, f"embed_tokens.weight: expected [vocab, hidden], got {w}")
    return (TensorType(w.dtype, ids.shape + (w.shape[1],)),)


EMBEDDING = OpDef("embedding", fixed_roles("ids", params=("embed_tokens.weight",)), {}, _infer_embedding,
                  doc="row gather: ids [...] -> [..., hidden]")


def _lm_head_roles(attrs):
    if attrs.get("tied"):
        return (Role("x"), Role("embed_tokens.weight", param=True))
    if is_mxfp4(attrs):
        return (Role("x"),) + packed_roles("lm_head.weight")
    return (Role("x"), Role("lm_head.weight", param=True))


def _check_lm_head(attrs):
    if attrs.get("tied") and is_mxfp4(attrs):
        raise TypeCheck("a tied lm_head reads the embedding table, which stays float (weight_format mxfp4 needs an "
                        "untied lm_head.weight)")


def _infer_lm_head(attrs, ins):
    x, d = activation(ins)
    role = "embed_tokens.weight" if attrs.get("tied") else "lm_head.weight"
    w = linear_weight(ins, role, is_mxfp4(attrs))
    require(w.rank == 2, f"{role}: expected [vocab, hidden], got {w}")
    expect(w, role, (None, d))
    return (TensorType(x.dtype, x.shape[:-1] + (w.shape[0],)),)


LM_HEAD = OpDef("lm_head", _lm_head_roles, {"tied": AttrSpec("bool", doc="weight shared with embed_tokens"),
                                            **MX_ATTRS},
                _infer_lm_head, _check_lm_head, doc="logits = x @ W^T, [..., hidden] -> [..., vocab]")

OP_DEFS = (INPUT, PARAM, ADD, RMSNORM, EMBEDDING, LM_HEAD)
