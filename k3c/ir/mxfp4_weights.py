"""MXFP4 linear weights in the IR (the `mxfp4` pass): the names and roles of a packed weight's two tensors, the
attrs of the ops that may read them, and the logical type of a packed pair.

A weight P quantized to MXFP4 is held as `packed_name(P, "weight_packed")` (u8 E2M1 payload, two values a byte)
and `packed_name(P, "weight_scale")` (u8 E8M0 scales, one per 32 along the reduction dim).
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import TensorType
from .opdef import AttrSpec, Role, expect

PACKED_PARTS = ("weight_packed", "weight_scale")
WEIGHT_FORMATS = ("bf16", "mxfp4")
MX_ATTRS = {      # on the ops whose plain GEMM weights the `mxfp4` pass may pack (lm_head, mlp, moe_linear)
    "weight_format": AttrSpec("str", required=False, choices=WEIGHT_FORMATS,
                              doc="the op's linear weights: float (absent = bf16) or MXFP4 packed + E8M0 scales"),
    "act_format": AttrSpec("str", required=False, choices=("bf16", "mxfp8", "mxfp4"),
                           doc="mxfp4 weights: the spec's activation format (native tl.dot_scaled where the target "
                               "has MX matrix units and activations are MX; upcast in registers elsewhere)"),
}


def packed_name(name: str, part: str) -> str:
    """The packed tensor of a weight (or role) quantized to MXFP4, `part` weight_packed | weight_scale:
    `lm_head.weight` -> `lm_head.weight_packed` (compressed-tensors' naming of a Linear), role `weight` ->
    `weight_packed`, an expert stack `...experts.w1` -> `...experts.w1.weight_packed`."""
    if name == "weight" or name.endswith(".weight"):
        return name[: -len("weight")] + part
    return f"{name}.{part}"


def packed_roles(role: str) -> tuple[Role, Role]:
    return tuple(Role(packed_name(role, part), param=True) for part in PACKED_PARTS)


def is_mxfp4(attrs: Mapping[str, Any]) -> bool:
    return attrs.get("weight_format", "bf16") == "mxfp4"


def linear_weight(ins: Mapping[str, TensorType], role: str, packed: bool) -> TensorType:
    """The logical [out, in] type of a linear weight role: the float tensor itself, or (packed) the float-typed view
    of its MXFP4 pair, u8 payload [out, in/2] + u8 E8M0 scales [out, in/32], checked against each other."""
    if not packed:
        return ins[role]
    u8 = frozenset({"u8"})
    p, s = (packed_name(role, part) for part in PACKED_PARTS)
    tp, ts = ins[p], ins[s]
    expect(tp, p, (None, None), u8)
    rows, half = tp.shape
    k = half * 2 if isinstance(half, int) else None
    expect(ts, s, (rows, k // 32 if isinstance(k, int) else None), u8)
    return TensorType("bf16", (rows, k))
