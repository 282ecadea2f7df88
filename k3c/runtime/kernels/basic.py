"""Kernel implementations of the generic ops (see k3c/codegen/emitters/basic.py for the AOT side)."""
from __future__ import annotations

from ...codegen import launch
from ...codegen.emitters.basic import act_from_attrs
from . import register_kernel_impl


@register_kernel_impl("embedding")
def embedding(a, cache, data, w):
    return launch.embedding(data[0], w["embed_tokens.weight"])


@register_kernel_impl("rmsnorm")
def rmsnorm(a, cache, data, w):
    return launch.rmsnorm(data[0], w["weight"], a["eps"])[0]


@register_kernel_impl("rmsnorm_residual")
def rmsnorm_residual(a, cache, data, w):
    out, summed = launch.rmsnorm(data[0], w["weight"], a["eps"], residual=data[1])
    return summed, out


@register_kernel_impl("mlp")
def mlp(a, cache, data, w):
    h = launch.gemm_glu(data[0], w["gate_proj.weight"], w["up_proj.weight"], act_from_attrs(a))
    return launch.gemm(h, w["down_proj.weight"])
