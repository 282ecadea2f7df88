"""MXFP4 dense linears (the `mxfp4` pass's weight_format "mxfp4" on lm_head, mlp and moe_linear): per op one entry
that picks, from the op's weight format, the dense MXFP4 x bf16 GEMM (k3c.codegen.kernels.moe, kind "dense": upcast
in registers on sm_90 / gfx942, tl.dot_scaled where the target has MX matrix units and the spec's activations are
MX) or the op's float path (basic.launch_mlp, moe.launch_moe_linear, moe.torch_moe_linear). The composed tables
(k3c.runtime.kernel_impls: OVERRIDES) hold these entries in place of the float families' ones.

The torch forms of MXFP4 weights are the eager reference: dequantize, then the float op (activations quantized per
32 first where the kernel runs the MX matrix units). The layer ops' torch path (lm_head, mlp, moe) is the
executor's, which takes its MXFP4 forms from here (torch_lm_head, torch_mlp, dequantized).

    mx_dense(x [..., K], packed u8 [N, K/2], scale u8 [N, K/32], act_format) -> x W^T   (one launch, or dequant +
                     bf16 GEMM at prefill buckets; the bucket of M picks the plan, as the AOT emitters do:
                     k3c/codegen/catalogue/mxfp4.py)
"""
from __future__ import annotations

import functools

import torch

from ...codegen.buckets import m_bucket
from ...codegen.catalogue.mxfp4 import dense_mx, dense_plan
from ...errors import IRError
from ...frontend.spec import ActivationSpec
from ...ir.mxfp4_weights import PACKED_PARTS, is_mxfp4, packed_name
from ...quant import mxfp4_dequantize
from ... import reference as ref
from ..caches.context import call_binding
from ..devices import tt_dtype
from ..launcher import Binding, target_of
from . import basic, moe

_dense_plan = functools.lru_cache(maxsize=256)(dense_plan)     # (m is already a bucket: few entries)


def mx_dense(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, act_format: str | None = None,
             ir_op: str = "mx_linear", *, binding: Binding | None = None) -> torch.Tensor:
    """x [..., K] W^T for W held as MXFP4 (packed [N, K/2], scales [N, K/32]) through the dense GEMM kernel."""
    tgt = target_of(binding, x.device)
    mx = _mode(x, act_format, binding)      # fp32 activations: upcast (the MX matrix units take bf16 / fp16)
    n, k = packed.shape[0], packed.shape[1] * 2
    m = x.numel() // max(1, x.shape[-1])
    plan = _dense_plan(n, k, m_bucket(m), mx, tt_dtype(x.dtype), tgt)
    return moe.mx_linear(x, packed, scale, mx=mx, plan=plan, ir_op=ir_op, binding=binding)


def _pair(w: dict, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(w[packed_name(role, p)] for p in PACKED_PARTS)


def dequantized(w: dict, roles, dtype: torch.dtype) -> dict:
    """`w` with each packed role pair replaced by its float weight (the reference's view)."""
    out = dict(w)
    for role in roles:
        p, s = (packed_name(role, part) for part in PACKED_PARTS)
        out[role] = mxfp4_dequantize(out.pop(p), out.pop(s), dtype)
    return out


def _mode(x: torch.Tensor, act_format: str | None, binding: Binding | None) -> str:
    """The MX mode the kernel runs for `x` (as mx_dense decides) on the target `binding` plans for."""
    mx = dense_mx(target_of(binding, x.device), act_format)
    return "upcast" if x.dtype == torch.float32 else mx


# ---- torch forms of MXFP4 weights (eager reference): dequantize, then the float op ------------------------------
def _aq(x: torch.Tensor, a, cache) -> torch.Tensor:
    """What the GEMM multiplies: x itself (upcast, bf16 activations), or on a target with MX matrix units x
    quantized per 32 to the spec's activation format, as the native kernel does in registers."""
    return moe.act_quantized(x, _mode(x, a.get("act_format"), call_binding(cache)))


def _dq(w: dict, role: str, dtype: torch.dtype) -> torch.Tensor:
    return mxfp4_dequantize(*_pair(w, role), dtype)


def torch_lm_head(a, cache, data, w):
    """An MXFP4 lm_head (the executor's lm_head takes it for weight_format "mxfp4")."""
    x = data[0]
    return ref.linear(_aq(x, a, cache), _dq(w, "lm_head.weight", x.dtype))


def torch_mlp(a, cache, data, w):
    """An MXFP4 dense MLP (the executor's mlp takes it for weight_format "mxfp4")."""
    x = data[0]
    xq = _aq(x, a, cache)
    h = ref.glu_act(ref.linear(xq, _dq(w, "gate_proj.weight", x.dtype)),
                    ref.linear(xq, _dq(w, "up_proj.weight", x.dtype)), ActivationSpec.from_attrs(a))
    return ref.linear(_aq(h, a, cache), _dq(w, "down_proj.weight", x.dtype))


def torch_moe_linear(a, cache, data, w):
    if not is_mxfp4(a):
        return moe.torch_moe_linear(a, cache, data, w)
    x = data[0]
    y = ref.linear(_aq(x, a, cache), _dq(w, "weight", x.dtype))
    return y + data[1] if a.get("residual") else y


# ---- kernel implementations ------------------------------------------------------------------------------------
def launch_lm_head(a, cache, data, w):
    if not is_mxfp4(a):     # torch runs a float lm_head on purpose: the codegen pass marks it extern, not kernel
        raise IRError("lm_head with float weights has no kernel implementation (it runs as impl=extern)")
    return mx_dense(data[0], *_pair(w, "lm_head.weight"), a.get("act_format"), "lm_head",
                    binding=call_binding(cache))


def launch_mlp(a, cache, data, w):
    if not is_mxfp4(a):
        return basic.launch_mlp(a, cache, data, w)
    x, af, b = data[0], a.get("act_format"), call_binding(cache)
    g = mx_dense(x, *_pair(w, "gate_proj.weight"), af, "mlp", binding=b)
    u = mx_dense(x, *_pair(w, "up_proj.weight"), af, "mlp", binding=b)
    return mx_dense(ref.glu_act(g, u, ActivationSpec.from_attrs(a)), *_pair(w, "down_proj.weight"), af, "mlp",
                    binding=b)


def launch_moe_linear(a, cache, data, w):
    if not is_mxfp4(a):
        return moe.launch_moe_linear(a, cache, data, w)
    y = mx_dense(data[0], *_pair(w, "weight"), a.get("act_format"), "moe_linear", binding=call_binding(cache))
    return y + data[1] if a.get("residual") else y


KERNEL_IMPLS = {"lm_head": launch_lm_head, "mlp": launch_mlp, "moe_linear": launch_moe_linear}
TORCH_IMPLS = {"moe_linear": torch_moe_linear}
