"""AOT emitters of the ops whose linear weights the `mxfp4` pass packed (weight_format "mxfp4": lm_head, mlp,
moe_linear): the dense MXFP4 x bf16 GEMM (k3c.codegen.kernels.moe, kind "dense") per token bucket, the kernels
k3c.runtime.kernel_impls.mxfp4_linear launches for the same shapes. Ops with float weights keep the emitters they had
(lm_head: torch on purpose, no emitter; the codegen pass marks only an MXFP4 lm_head "kernel")."""
from __future__ import annotations

from ...ir.ops import PACKED_PARTS, get_op_def, is_mxfp4, packed_name
from ..kernels.moe import DEQUANT_BLOCKS, DEQUANT_WORKSPACE_BYTES, expert_gemm_classes, moe_gemm_plan, mx_mode
from ..launch import M_BUCKETS, m_bucket
from . import EMITTERS, register_emitter

_DT = {"bf16": "bf16", "f32": "fp32", "f16": "fp16"}


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
    """The plan of the dense GEMM for M tokens: tiles by the token bucket (launch.m_bucket); no dequant plan for
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


def _op_kernels(op, module, target, roles):
    x = module.types[op.inputs[0]]
    ins = dict(zip((r.name for r in get_op_def(op.op).roles(op.attr_dict)), op.inputs))
    out = []
    for role in roles:
        p = module.types[ins[packed_name(role, PACKED_PARTS[0])]]
        out += dense_kernels(p.shape[0], p.shape[1] * 2, _DT[x.dtype], target, op.attr("act_format", None), op.op)
    return out


def _wrap(op_name: str, roles):
    inner = EMITTERS.get(op_name)

    def emit(op, module, target):
        if is_mxfp4(op.attr_dict):
            return _op_kernels(op, module, target, roles)
        if inner is None:
            return []
        return inner(op, module, target)
    return emit


for _name, _roles in (("lm_head", ("lm_head.weight",)),
                      ("mlp", ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
                      ("moe_linear", ("weight",))):
    register_emitter(_name)(_wrap(_name, _roles))
