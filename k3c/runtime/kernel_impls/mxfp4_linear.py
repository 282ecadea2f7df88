"""MXFP4 dense linears (the `mxfp4` pass's weight_format "mxfp4" on lm_head, mlp and moe_linear): their kernel
implementations through the dense MXFP4 x bf16 GEMM (k3c.codegen.kernels.moe, kind "dense": upcast in registers on
sm_90 / gfx942, tl.dot_scaled where the target has MX matrix units and the spec's activations are MX), and their
torch implementations (the eager reference: dequantize, then the float op).

Ops with float weights run exactly as before: each wrapper hands them to the implementation it replaces.

    mx_dense(x [..., K], packed u8 [N, K/2], scale u8 [N, K/32], act_format) -> x W^T   (one launch, or dequant +
                     bf16 GEMM at prefill buckets; the bucket of M picks the plan, as the AOT emitters do:
                     k3c/codegen/catalogue/mxfp4.py)
"""
from __future__ import annotations

import functools

import torch

from ...codegen.catalogue.basic import act_from_attrs
from ...codegen.catalogue.mxfp4 import dense_mx, dense_plan
from ...codegen.launch import m_bucket, target_for, tt_dtype
from ...ir.ops import PACKED_PARTS, is_mxfp4, packed_name
from ...quant import mxfp4_dequantize
from ... import reference as ref
from ..executor import IMPLS, register_impl
from . import KERNEL_IMPLS, register_kernel_impl
from . import moe as _moe


_dense_plan = functools.lru_cache(maxsize=256)(dense_plan)     # (m is already a bucket: few entries)


def mx_dense(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, act_format: str | None = None,
             ir_op: str = "mx_linear") -> torch.Tensor:
    """x [..., K] W^T for W held as MXFP4 (packed [N, K/2], scales [N, K/32]) through the dense GEMM kernel."""
    tgt = target_for(x.device)
    mx = _mode(x, act_format)      # fp32 activations: upcast (the MX matrix units take bf16 / fp16)
    n, k = packed.shape[0], packed.shape[1] * 2
    m = x.numel() // max(1, x.shape[-1])
    plan = _dense_plan(n, k, m_bucket(m), mx, tt_dtype(x.dtype), tgt)
    return _moe.mx_linear(x, packed, scale, mx=mx, plan=plan, ir_op=ir_op)


def _pair(w: dict, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(w[packed_name(role, p)] for p in PACKED_PARTS)


def dequantized(w: dict, roles, dtype: torch.dtype) -> dict:
    """`w` with each packed role pair replaced by its float weight (the reference's view)."""
    out = dict(w)
    for role in roles:
        p, s = (packed_name(role, part) for part in PACKED_PARTS)
        out[role] = mxfp4_dequantize(out.pop(p), out.pop(s), dtype)
    return out


# ---- torch implementations (eager reference): dequantize, then the float op -----------------------------------
def _mode(x: torch.Tensor, act_format: str | None) -> str:
    """The MX mode the kernel runs for `x` (as mx_dense decides)."""
    mx = dense_mx(target_for(x.device), act_format)
    return "upcast" if x.dtype == torch.float32 else mx


def _aq(x: torch.Tensor, a) -> torch.Tensor:
    """What the GEMM multiplies: x itself (upcast, bf16 activations), or on a target with MX matrix units x
    quantized per 32 to the spec's activation format, as the native kernel does in registers."""
    return _moe._act_quant(x, _mode(x, a.get("act_format")))


def _dq(w: dict, role: str, dtype: torch.dtype) -> torch.Tensor:
    return mxfp4_dequantize(*_pair(w, role), dtype)


def torch_lm_head(a, data, w):
    x = data[0]
    return ref.linear(_aq(x, a), _dq(w, "lm_head.weight", x.dtype))


def torch_mlp(a, data, w):
    x = data[0]
    xq = _aq(x, a)
    h = ref.glu_act(ref.linear(xq, _dq(w, "gate_proj.weight", x.dtype)),
                    ref.linear(xq, _dq(w, "up_proj.weight", x.dtype)), act_from_attrs(a))
    return ref.linear(_aq(h, a), _dq(w, "down_proj.weight", x.dtype))


def torch_moe_linear(a, data, w):
    x = data[0]
    y = ref.linear(_aq(x, a), _dq(w, "weight", x.dtype))
    return y + data[1] if a.get("residual") else y


def _reference(op_name: str, mx_impl):
    inner = IMPLS[op_name]

    def impl(a, cache, data, w):
        if is_mxfp4(a):
            return mx_impl(a, data, w)
        return inner(a, cache, data, w)
    impl.__name__ = f"k3c_{op_name}"
    impl.__qualname__ = impl.__name__
    impl.__wrapped__ = inner
    return impl


def _moe_reference():
    """The layer-level moe op (graphs without moe-lower): its packed dense linears dequantized, then the reference
    MoE (float activations: the layer reference)."""
    inner = IMPLS["moe"]

    def k3c_moe(a, cache, data, w):
        roles = tuple(a.get("mxfp4_linears", ()) or ())
        if roles:
            w = dequantized(w, roles, data[0].dtype)
            a = {k: v for k, v in a.items() if k != "mxfp4_linears"}
        return inner(a, cache, data, w)
    k3c_moe.__wrapped__ = inner
    return k3c_moe


for _name, _fn in (("lm_head", torch_lm_head), ("mlp", torch_mlp), ("moe_linear", torch_moe_linear)):
    register_impl(_name, _reference(_name, _fn))
register_impl("moe", _moe_reference())


# ---- kernel implementations ------------------------------------------------------------------------------------
def _kernel(op_name: str, mx_impl):
    inner = KERNEL_IMPLS.get(op_name)

    def impl(a, cache, data, w):
        if is_mxfp4(a):
            return mx_impl(a, data, w)
        if inner is None:       # lm_head: torch on purpose for float weights (the codegen pass marks it extern)
            return IMPLS[op_name](a, cache, data, w)
        return inner(a, cache, data, w)
    impl.__name__ = f"kernel_{op_name}"
    return impl


def _lm_head(a, data, w):
    return mx_dense(data[0], *_pair(w, "lm_head.weight"), a.get("act_format"), "lm_head")


def _mlp(a, data, w):
    x, af = data[0], a.get("act_format")
    g = mx_dense(x, *_pair(w, "gate_proj.weight"), af, "mlp")
    u = mx_dense(x, *_pair(w, "up_proj.weight"), af, "mlp")
    return mx_dense(ref.glu_act(g, u, act_from_attrs(a)), *_pair(w, "down_proj.weight"), af, "mlp")


def _moe_linear(a, data, w):
    y = mx_dense(data[0], *_pair(w, "weight"), a.get("act_format"), "moe_linear")
    return y + data[1] if a.get("residual") else y


for _name, _fn in (("lm_head", _lm_head), ("mlp", _mlp), ("moe_linear", _moe_linear)):
    register_kernel_impl(_name)(_kernel(_name, _fn))
