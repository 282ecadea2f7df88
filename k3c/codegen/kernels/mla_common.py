"""Pieces shared by the MLA kernel emitters (mla.py, mla_latent.py): tile extents, the dot operand / precision
parts and the checks of baked-in floats."""
from __future__ import annotations

import math

from ..writer import CodegenError
from .common import TL_DTYPE, pow2_ceil

LOG2E = 1.4426950408889634


def _blk(n: int) -> int:
    """A tile extent for a head dim: a power of two, at least 16 (tl.dot needs K >= 16 on GPUs; padding is masked)."""
    return max(16, pow2_ceil(n))


def _dot_parts(dtype: str, interp: bool) -> tuple[str, str]:
    """(operand upcast suffix, tl.dot keyword) for operands of `dtype` (interpreter: bf16 -> fp32 copies; fp32 on
    GPUs: exact IEEE products, not tf32)."""
    if dtype == "fp32":
        return "", ', input_precision="ieee"'
    if interp:
        return ".to(tl.float32)", ', input_precision="ieee"'
    return "", ""


def _p_cast(dtype: str, interp: bool) -> str:
    """The softmax weights p as the P @ V dot's operand: `dtype` on GPUs (fp32 stays fp32), fp32 in the
    interpreter (whose bf16 dot is not one)."""
    return "p" if dtype == "fp32" or interp else f"p.to({TL_DTYPE[dtype]})"


def _check_scale(scale: object) -> float:
    if not (isinstance(scale, float) and scale > 0 and math.isfinite(scale)):
        raise CodegenError(f"scale must be a finite positive float, got {scale!r}")
    return scale


def _check_eps(eps: object) -> float:
    if not (isinstance(eps, float) and eps >= 0 and math.isfinite(eps)):
        raise CodegenError(f"eps must be a finite float >= 0, got {eps!r}")
    return eps
