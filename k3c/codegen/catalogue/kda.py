"""AOT emitters of the kda-chunk pass's kernel-level ops: the KernelSources the runtime launches for them
(k3c.runtime.kernel_impls.kda calls the same emit_* functions with the same arguments)."""
from __future__ import annotations

from ..kernel import KernelSource
from ..kernels.common import IR_DTYPES
from ..kernels.gemm import emit_gemm
from ..kernels.kda import (DECODE_NORM_EPS, emit_kda_inter, emit_kda_intra, emit_kda_out, emit_kda_prep, kda_plan,
                           prep_qkv_dtype, run_dot)
from ..kernels.kda_decode_hopper import decode_kernel


def _dtype(module, value: str) -> str:
    return IR_DTYPES.get(module.types[value].dtype, "bf16")


def emit_attn(op, module, target) -> list[KernelSource]:
    """prep + the two prefill kernels (intra-chunk, state passing; initial state in) and the fused decode step (o
    out, kda_out follows)."""
    a = op.attr_dict
    dt = _dtype(module, op.inputs[0])
    h, d = a["num_heads"], a["head_dim"]
    loc = op.loc or ""
    dot = run_dot(dt, a["dot"])
    plan = kda_plan(d, dt, target, chunk=a["chunk"], block_v=min(a["block_v"], d), dot=dot)
    qkv = prep_qkv_dtype(dot)                           # the prep's q / k / v rows
    common = dict(gate=a["gate"], gate_lower_bound=a["gate_lower_bound"], l2norm_eps=a["l2norm_eps"], target=target,
                  dtype=dt, ir_op="kda_attn", loc=loc)
    return [emit_kda_prep(h, d, a["conv_kernel"], qkv_dtype=qkv, **common),
            emit_kda_intra(h, d, target=target, qk_dtype=qkv, plan=plan, ir_op="kda_attn", loc=loc),
            emit_kda_inter(h, d, target=target, v_dtype=qkv, plan=plan, ir_op="kda_attn", loc=loc),
            decode_kernel(h, d, a["conv_kernel"], norm_eps=DECODE_NORM_EPS, fuse_out=False, plan=plan, **common)]


def emit_out(op, module, target) -> list[KernelSource]:
    a = op.attr_dict
    return [emit_kda_out(a["num_heads"], a["head_dim"], norm_eps=a["norm_eps"], target=target,
                         dtype=_dtype(module, op.inputs[1]), ir_op="kda_out", loc=op.loc or "")]


def emit_proj(op, module, target) -> list[KernelSource]:
    """The generated GEMM (k3c.runtime.kernel_impls.basic.gemm with ir_op="kda_proj"), one per token-count bucket."""
    from ..buckets import M_BUCKETS

    w = module.types[op.inputs[1]]
    dt, wdt = _dtype(module, op.inputs[0]), IR_DTYPES.get(w.dtype, "bf16")
    return [emit_gemm(w.shape[0], w.shape[1], target=target, m_hint=m, dtype=dt, w_dtype=wdt, out_dtype=dt,
                      ir_op="kda_proj", interpret=False) for m in M_BUCKETS]


EMITTERS = {"kda_attn": emit_attn, "kda_out": emit_out, "kda_proj": emit_proj}
