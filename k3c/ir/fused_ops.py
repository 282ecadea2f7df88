"""Generic fused ops the `fuse-residual-norm` pass introduces."""
from __future__ import annotations

from .opdef import AttrSpec, OpDef, activation, expect, fixed_roles, same_type


def _infer_rmsnorm_residual(attrs, ins):
    s = same_type(ins, ("x", "residual"))
    _, d = activation(ins)
    expect(ins["weight"], "weight", (d,))
    return (s, s)


RMSNORM_RESIDUAL = OpDef("rmsnorm_residual", fixed_roles("x", "residual", params=("weight",)),
                         {"eps": AttrSpec("float")}, _infer_rmsnorm_residual, num_results=2,
                         doc="s = x + residual; (s, s / sqrt(mean(s^2) + eps) * weight): the residual add fused "
                             "into the norm that reads it")

OP_DEFS = (RMSNORM_RESIDUAL,)
