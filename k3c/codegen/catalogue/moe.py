"""AOT emitters of the moe-lower pass's ops: the kernels k3c.runtime.kernel_impls.moe launches for them, with the same
emit_* arguments (router / latent GEMMs per token bucket, the three routing kernels, the grouped GEMMs per
rows-per-expert class, both answers of the scale check: expert_gemm_classes; the hopper form's classes where the op's
expert_layout is "hopper"), the combine). moe_linear with MXFP4
weights: k3c.codegen.catalogue.mxfp4, whose entry picks this float emitter or the MXFP4 kernels."""
from __future__ import annotations

from ...frontend.spec import ActivationSpec
from ...ir.ops import bind
from ..buckets import M_BUCKETS
from ..kernels.common import IR_DTYPES
from ..kernels.moe import (emit_moe_combine, emit_moe_linear, emit_moe_offsets, emit_moe_rank, emit_moe_scatter,
                           emit_moe_topk, expert_gemm_classes, mx_mode)


def _ep(a):
    """(local experts, the first local expert, EP ranks) of an op's attrs."""
    size = a.get("ep_size", 1)
    el = a["num_experts"] // size
    return el, a.get("ep_rank", 0) * el, size


def moe_linear(op, module, target):
    ins = bind(op)
    dt, wt = IR_DTYPES[module.type_of(ins["x"]).dtype], module.type_of(ins["weight"])
    odt = "fp32" if op.attr("out_f32", False) else dt
    return [emit_moe_linear(wt.shape[0], wt.shape[1], target=target, m_hint=m, dtype=dt, w_dtype=IR_DTYPES[wt.dtype],
                            out_dtype=odt, residual=bool(op.attr("residual", False)), interpret=False)
            for m in M_BUCKETS]


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


def _grouped(op, module, target, kind: str, activations: str, first_weight: str):
    """Every kernel the runtime may launch for the grouped GEMM of `kind` (expert_gemm_classes)."""
    a, ins = op.attr_dict, bind(op)
    el, _, _ = _ep(a)
    x = module.type_of(ins[activations])
    w = module.type_of(ins[first_weight])
    mx = mx_mode(a.get("expert_format", "bf16"), target, a.get("act_format"), a["mx"])
    n, k = w.shape[1], x.shape[-1]
    dt = IR_DTYPES[x.dtype]
    act = ActivationSpec.from_attrs(a) if kind == "gate_up" else None
    return expert_gemm_classes(kind, n, k, target=target, mx=mx, dtype=dt,
                               hopper=mx == "upcast" and a.get("expert_layout", "canonical") == "hopper",
                               w_dtype=None if mx != "none" else IR_DTYPES[w.dtype], out_dtype=dt, act=act,
                               num_experts=el, top_k=a["top_k"], ir_op=f"moe_{kind}", interpret=False)


def _first_expert(a, name: str) -> str:
    return f"experts.{name}.weight_packed" if a.get("expert_format", "bf16") == "mxfp4" else f"experts.{name}"


def moe_gate_up(op, module, target):
    return _grouped(op, module, target, "gate_up", "z", _first_expert(op.attr_dict, "w1"))


def moe_down(op, module, target):
    return _grouped(op, module, target, "down", "h", _first_expert(op.attr_dict, "w2"))


def moe_combine(op, module, target):
    a = op.attr_dict
    el, e0, size = _ep(a)
    y = module.type_of(bind(op)["y"])
    return [emit_moe_combine(y.shape[-1], a["top_k"], target=target, dtype=IR_DTYPES[y.dtype],
                             residual=bool(a.get("residual", False)), e_local=el if size > 1 else None, e0=e0,
                             ir_op="moe_combine", loc="", interpret=False)]


EMITTERS = {"moe_linear": moe_linear, "moe_route": moe_route, "moe_gate_up": moe_gate_up, "moe_down": moe_down,
            "moe_combine": moe_combine}
