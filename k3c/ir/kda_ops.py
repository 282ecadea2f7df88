"""Kernel-level KDA ops the `kda-chunk` pass introduces (K3.md section 2).

    kda_proj  y = x W^T                                  a dense projection (q/k/v/f_a/f_b/b/g/o): extern GEMM
    kda_attn  the KDA core on the projections: fused input prep (causal short conv with conv tails, SiLU, L2 norm,
              gate activation, beta sigmoid) + the delta-rule scan: chunked UT/WY prefill for T > 1, fused recurrent
              decode for T = 1 (prep and conv-tail update inside the step). fp32 state and conv tails live in the
              layer's cache entry (KDAState): initial state in, final state out. Result o: f32 [B, T, H, D].
    kda_out   per-head RMSNorm (o_norm) x sigmoid(output gate), in the gate's dtype: [B, T, H*D].
"""
from __future__ import annotations

from .core import TensorType
from .opdef import AttrSpec, OpDef, TypeCheck, activation, check_positive, expect, fixed_roles, require


def _infer_proj(attrs, ins):
    x, d = activation(ins)
    w = ins["weight"]
    require(w.rank == 2, f"weight: expected [out, in], got {w}")
    expect(w, "weight", (None, d))
    return (TensorType(x.dtype, x.shape[:-1] + (w.shape[0],)),)


KDA_PROJ = OpDef("kda_proj", fixed_roles("x", params=("weight",)), {
    "proj": AttrSpec("str", doc="which projection (q, k, v, f_a, f_b, b, g, g_a, g_b, o)"),
}, _infer_proj, doc="dense projection x @ W^T of a KDA layer (extern GEMM)")

ATTN_PARAMS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log", "dt_bias")


def _check_attn(attrs):
    if not isinstance(attrs.get("layer"), int):
        raise TypeCheck("kda_attn needs the 'layer' attribute (its state lives in that layer's cache entry)")
    check_positive(attrs, "num_heads", "head_dim", "conv_kernel", "chunk", "block_v")
    if attrs.get("gate") == "safe" and not attrs.get("gate_lower_bound", -1.0) < 0:
        raise TypeCheck("the safe gate needs gate_lower_bound < 0")


def _infer_attn(attrs, ins):
    h, k, kw = attrs["num_heads"], attrs["head_dim"], attrs["conv_kernel"]
    q, _ = activation(ins, "q")
    w = h * k
    for r in ("q", "k", "v", "f"):
        t = ins[r]
        expect(t, r, q.shape[:-1] + (w,))
        require(t.dtype == q.dtype, f"{r}: expected dtype {q.dtype} (as q), got {t}")
    expect(ins["b"], "b", q.shape[:-1] + (h,))
    for p in "qkv":
        expect(ins[f"{p}_conv1d.weight"], f"{p}_conv1d.weight", (w, 1, kw))
    expect(ins["A_log"], "A_log", (h,))
    expect(ins["dt_bias"], "dt_bias", (w,))
    return (TensorType("f32", q.shape[:-1] + (h, k)),)


KDA_ATTN = OpDef("kda_attn", fixed_roles("q", "k", "v", "f", "b", params=ATTN_PARAMS), {
    "num_heads": AttrSpec("int"),
    "head_dim": AttrSpec("int"),
    "conv_kernel": AttrSpec("int"),
    "gate": AttrSpec("str", choices=("softplus", "safe")),
    "gate_lower_bound": AttrSpec("float"),
    "l2norm_eps": AttrSpec("float"),
    "chunk": AttrSpec("int", doc="tokens per chunk step of the prefill kernel (sub-chunk of the target's chunk)"),
    "block_v": AttrSpec("int", doc="V columns per prefill program"),
    "dot": AttrSpec("str", choices=("ieee", "tf32", "bf16"), doc="matmul precision of the prefill kernel"),
}, _infer_attn, _check_attn, pure=False, sequence_state=True,
    doc="KDA core (stateful: reads and writes the layer's KDAState): prep + chunked prefill / fused decode")


def _infer_out(attrs, ins):
    o, g = ins["o"], ins["gate"]
    h, k = attrs["num_heads"], attrs["head_dim"]
    require(o.dtype == "f32", f"o: expected f32, got {o}")
    require(o.rank >= 2 and tuple(o.shape[-2:]) == (h, k), f"o: expected [..., {h}, {k}], got {o}")
    expect(g, "gate", o.shape[:-2] + (h * k,))
    expect(ins["o_norm.weight"], "o_norm.weight", (k,))
    return (g,)


KDA_OUT = OpDef("kda_out", fixed_roles("o", "gate", params=("o_norm.weight",)), {
    "num_heads": AttrSpec("int"),
    "head_dim": AttrSpec("int"),
    "norm_eps": AttrSpec("float"),
}, _infer_out, doc="per-head RMSNorm(o) x sigmoid(gate), flattened to [..., H*D] in the gate's dtype")

OP_DEFS = (KDA_PROJ, KDA_ATTN, KDA_OUT)
