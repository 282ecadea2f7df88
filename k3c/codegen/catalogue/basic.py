"""Emitters for the generic ops: embedding, rmsnorm, rmsnorm_residual, dense MLP (gate/up GEMM with the GLU
epilogue, then the down GEMM). They call the same emit_* functions, with the same arguments, as the runtime
wrappers in k3c.runtime.kernel_impls.basic, so the AOT artifact holds the kernels that run."""
from __future__ import annotations

from ...frontend.spec import ActivationSpec
from ..buckets import M_BUCKETS as GEMM_M_BUCKETS   # the token-count buckets the runtime specialises GEMMs for
from ..kernels import emit_embedding, emit_gemm, emit_gemm_glu, emit_rmsnorm
from ..kernels.common import IR_DTYPES, glu_act


def _dt(t) -> str:
    return IR_DTYPES[t.dtype]


def _ir(op) -> str:
    # the op kind, not the value name: one kernel serves every op of the same shapes (and the same YAML field)
    return op.op


def embedding(op, module, target):
    table = module.type_of(op.inputs[1])
    return [emit_embedding(table.shape[0], table.shape[1], target=target, dtype=_dt(table),
                           ids_dtype="i64", ir_op=_ir(op), loc=op.loc)]


def rmsnorm(op, module, target):
    x, w = module.type_of(op.inputs[0]), module.type_of(op.inputs[1])
    return [emit_rmsnorm(x.shape[-1], float(op.attr("eps")), target=target, dtype=_dt(x), weight_dtype=_dt(w),
                         ir_op=_ir(op), loc=op.loc, interpret=False)]


def rmsnorm_residual(op, module, target):
    x, w = module.type_of(op.inputs[0]), module.type_of(op.inputs[2])
    return [emit_rmsnorm(x.shape[-1], float(op.attr("eps")), target=target, dtype=_dt(x), residual=True,
                         residual_dtype=_dt(x), out_dtype=_dt(x), weight_dtype=_dt(w), ir_op=_ir(op), loc=op.loc,
                         interpret=False)]


def mlp(op, module, target):
    x = module.type_of(op.inputs[0])
    gate, down = module.type_of(op.inputs[1]), module.type_of(op.inputs[3])
    f, d = gate.shape
    act = glu_act(ActivationSpec.from_attrs(op.attr_dict))
    out = []
    for m in GEMM_M_BUCKETS:
        out.append(emit_gemm_glu(f, d, act, target=target, m_hint=m, dtype=_dt(x), w_dtype=_dt(gate),
                                 out_dtype=_dt(x), ir_op=_ir(op), loc=op.loc, interpret=False))
        out.append(emit_gemm(down.shape[0], down.shape[1], target=target, m_hint=m, dtype=_dt(x),
                             w_dtype=_dt(down), out_dtype=_dt(x), ir_op=_ir(op), loc=op.loc, interpret=False))
    return out


EMITTERS = {"embedding": embedding, "rmsnorm": rmsnorm, "rmsnorm_residual": rmsnorm_residual, "mlp": mlp}
