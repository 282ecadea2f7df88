"""AOT emitters of the ops whose linear weights the `mxfp4` pass may pack (weight_format "mxfp4": lm_head, mlp,
moe_linear): per op one entry that picks, from the op's weight format, the dense MXFP4 x bf16 GEMM (k3c.codegen.
kernels.moe, kind "dense") per token bucket, the kernels k3c.runtime.kernel_impls.mxfp4_linear launches for the same
shapes, or the op's float emitter (basic.mlp, moe.moe_linear; a float lm_head has none: torch runs it on purpose,
and the codegen pass marks only an MXFP4 lm_head "kernel"). The catalogue applies these entries over the float
families' (k3c.codegen.catalogue: OVERRIDES)."""
from __future__ import annotations

from ...ir.mxfp4_weights import PACKED_PARTS, is_mxfp4, packed_name
from ...ir.ops import bind
from ..buckets import M_BUCKETS, m_bucket
from ..kernels.common import IR_DTYPES
from ..kernels.moe import DEQUANT_BLOCKS, DEQUANT_WORKSPACE_BYTES, expert_gemm_classes, moe_gemm_plan, mx_mode
from . import basic, moe


def dense_mx(target, act_format: str | None) -> str:
    """The MX mode of a dense MXFP4 GEMM on `target`, decided as for the routed experts (mx_mode): tl.dot_scaled
    where the target has MX matrix units and the spec's activations are MX, upcast in registers elsewhere."""
    return mx_mode("mxfp4", target, act_format or "bf16", "auto")


def dequant_fits(n: int, k: int) -> bool:
    """Whether the prefill dequant plan can take an [n, k] weight: its bf16 workspace within
    DEQUANT_WORKSPACE_BYTES and the dequant kernel's grid (cdiv(n * k / 32, DEQUANT_BLOCKS) programs in dim 1)
    within CUDA's 65535. K3's lm_head (163840 x 7168: 2.35 GB, 143360 programs) does not: it runs the MMA form."""
    return n * k * 2 <= DEQUANT_WORKSPACE_BYTES and -(-(n * (k // 32)) // DEQUANT_BLOCKS) <= 65535


def dense_plan(n: int, k: int, m: int, mx: str, dtype: str, target, one_mul: bool | None = None):
    """The plan of the dense GEMM for M tokens: tiles by the token bucket (buckets.m_bucket); no dequant plan for
    a weight that `dequant_fits` refuses."""
    return moe_gemm_plan("dense", n, k, m_bucket(m), mx, dtype, target, one_mul=one_mul,
                         dequant=None if dequant_fits(n, k) else False)


def dense_kernels(n: int, k: int, dtype: str, target, act_format: str | None, ir_op: str, loc: str = ""):
    """Every kernel the runtime may launch for an MXFP4 weight [n, k] with `dtype` activations: per token bucket,
    the pair decode in both its one- and two-multiply forms (the runtime picks by the weights' scales), the dequant
    kernel + bf16 dense GEMM where a bucket takes the dequant plan."""
    mx = dense_mx(target, act_format)
    if dtype == "fp32":             # the MX matrix units take bf16 / fp16 activations (as the runtime decides)
        mx = "upcast"
    return expert_gemm_classes("dense", n, k, target=target, rows=M_BUCKETS,
                               plan_for=lambda m: dense_plan(n, k, m, mx, dtype, target), mx=mx, dtype=dtype,
                               w_dtype=dtype, out_dtype=dtype, ir_op=ir_op, loc=loc, interpret=False)


def _mx_kernels(op, module, target, roles):
    """The dense MXFP4 GEMMs of the op's packed weight roles (each [n, k / 2] packed bytes)."""
    ins = bind(op)
    dt = IR_DTYPES[module.type_of(ins["x"]).dtype]
    out = []
    for role in roles:
        p = module.type_of(ins[packed_name(role, PACKED_PARTS[0])])
        out += dense_kernels(p.shape[0], p.shape[1] * 2, dt, target, op.attr("act_format", None), op.op)
    return out


def lm_head(op, module, target):
    return _mx_kernels(op, module, target, ("lm_head.weight",)) if is_mxfp4(op.attr_dict) else []


def mlp(op, module, target):
    if is_mxfp4(op.attr_dict):
        return _mx_kernels(op, module, target, ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    return basic.mlp(op, module, target)


def moe_linear(op, module, target):
    if is_mxfp4(op.attr_dict):
        return _mx_kernels(op, module, target, ("weight",))
    return moe.moe_linear(op, module, target)


EMITTERS = {"lm_head": lm_head, "mlp": mlp, "moe_linear": moe_linear}
