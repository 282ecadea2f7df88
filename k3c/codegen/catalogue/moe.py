"""AOT emitters of the moe-lower pass's ops: the kernels k3c.runtime.kernel_impls.moe launches for them, with the same
emit_* arguments (router / latent GEMMs per token bucket, the three routing kernels, the grouped GEMMs per
rows-per-expert class, both answers of the scale check: expert_gemm_classes), the combine)."""
from __future__ import annotations

from ..kernels.moe import (emit_moe_combine, emit_moe_linear, emit_moe_offsets, emit_moe_rank, emit_moe_scatter,
                           emit_moe_topk, expert_gemm_classes, mx_mode)
from . import register_emitter
from .basic import act_from_attrs

_DT = {"bf16": "bf16", "f32": "fp32", "f16": "fp16"}


def _dt(module, value: str) -> str:
    return _DT[module.types[value].dtype]


def _ep(a):
    size = a.get("ep_size", 1)
    el = a["num_experts"] // size
    return el, a.get("ep_rank", 0) * el, size


@register_emitter("moe_linear")
def moe_linear(op, module, target):
    from ..launch import M_BUCKETS

    x, wt = op.inputs[0], module.types[op.inputs[1]]
    dt = _dt(module, x)
    odt = "fp32" if op.attr("out_f32", False) else dt
    return [emit_moe_linear(wt.shape[0], wt.shape[1], target=target, m_hint=m, dtype=dt, w_dtype=_DT[wt.dtype],
                            out_dtype=odt, residual=bool(op.attr("residual", False)), interpret=False)
            for m in M_BUCKETS]


@register_emitter("moe_route")
def moe_route(op, module, target):
    a = op.attr_dict
    el, e0, _ = _ep(a)
    e, k = a["num_experts"], a["top_k"]
    return [emit_moe_topk(e, k, target=target, router_activation=a["router_activation"], bias=a["router_bias"],
                          renormalize=a["renormalize"], scaling=float(a["routed_scaling_factor"]), e_local=el, e0=e0,
                          ir_op="moe_route", loc=""),
            emit_moe_rank(el, target=target, ir_op="moe_route", loc=""),
            emit_moe_offsets(el, target=target, ir_op="moe_route", loc=""),
            emit_moe_scatter(el, k, target=target, e0=e0, ir_op="moe_route", loc="")]


def _grouped(op, module, target, kind):
    a = op.attr_dict
    el, _, _ = _ep(a)
    x = module.types[op.inputs[0]]
    w = module.types[op.inputs[3]]
    mx = mx_mode(a.get("expert_format", "bf16"), target, a.get("act_format"), a["mx"])
    n, k = w.shape[1], x.shape[-1]
    dt = _DT[x.dtype]
    act = act_from_attrs(a) if kind == "gate_up" else None
    return expert_gemm_classes(kind, n, k, target=target, mx=mx, dtype=dt,
                               w_dtype=None if mx != "none" else _DT[w.dtype], out_dtype=dt, act=act,
                               num_experts=el, top_k=a["top_k"], ir_op=f"moe_{kind}", interpret=False)


@register_emitter("moe_gate_up")
def moe_gate_up(op, module, target):
    return _grouped(op, module, target, "gate_up")


@register_emitter("moe_down")
def moe_down(op, module, target):
    return _grouped(op, module, target, "down")


@register_emitter("moe_combine")
def moe_combine(op, module, target):
    a = op.attr_dict
    el, e0, size = _ep(a)
    y = module.types[op.inputs[0]]
    return [emit_moe_combine(y.shape[-1], a["top_k"], target=target, dtype=_DT[y.dtype],
                             residual=bool(a.get("residual", False)), e_local=el if size > 1 else None, e0=e0,
                             ir_op="moe_combine", loc="", interpret=False)]
