"""Pieces shared by the MLA kernel emitters (mla.py, mla_latent.py): tile extents, the dot operand / precision
parts, the checks of baked-in floats and the row layout of the latent cache.

Latent cache rows. A bf16 / fp32 cache row is the L latent values then the R rope values in that dtype. An fp8
cache (LATENT_FP8: OCP e4m3, torch.float8_e4m3fn) row is, in bytes: the L + R codes, zero padding, and at the last 8
bytes of the row two fp32 scales (the L latent values', then the R rope values'); the row is padded to a multiple
of 16 bytes (vector loads), so 576 values take 592 bytes. Scales are per token and per part: scale = amax / 448
over the part (1 for an all-zero part), code = e4m3(clamp(value / scale)) with round-to-nearest-even, value =
code * scale. The writer knows the whole row, so nothing is calibrated, nothing saturates and a token's codes do
not depend on the other tokens of its batch or page (the latent part is an RMSNorm output, the rope part is not:
one scale for both would cost the smaller part its precision)."""
from __future__ import annotations

import math

from ..writer import CodegenError
from .common import TL_DTYPE, pow2_ceil

LOG2E = 1.4426950408889634
LATENT_FP8 = "fp8e4nv"     # the fp8 latent cache's code dtype
FP8_MAX = 448.0            # largest finite e4m3 value
CACHE_DTYPES = ("bf16", "fp16", "fp32", LATENT_FP8)


def latent_row_width(kv_lora_rank: int, rope_dim: int, cache_dtype: str) -> int:
    """Elements (of the cache dtype) per cached token: L + R, or for fp8 the codes, padding and the two fp32 scales
    rounded up to 16 bytes (see the module doc)."""
    if cache_dtype not in CACHE_DTYPES:
        raise CodegenError(f"cache dtype must be one of {CACHE_DTYPES}, got {cache_dtype!r}")
    if cache_dtype != LATENT_FP8:
        return kv_lora_rank + rope_dim
    return -(-(kv_lora_rank + rope_dim + 8) // 16) * 16


def latent_scale_index(kv_lora_rank: int, rope_dim: int) -> int:
    """fp32 index, within an fp8 row seen as fp32 words, of the latent part's scale (the rope part's is next)."""
    return latent_row_width(kv_lora_rank, rope_dim, LATENT_FP8) // 4 - 2


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


def _p_cast(dtype: str, interp: bool, p: str = "p") -> str:
    """The softmax weights `p` as the P @ V dot's operand: `dtype` on GPUs (fp32 stays fp32), fp32 in the
    interpreter (whose bf16 dot is not one)."""
    return p if dtype == "fp32" or interp else f"{p}.to({TL_DTYPE[dtype]})"


def _check_scale(scale: object) -> float:
    if not (isinstance(scale, float) and scale > 0 and math.isfinite(scale)):
        raise CodegenError(f"scale must be a finite positive float, got {scale!r}")
    return scale


def _check_eps(eps: object) -> float:
    if not (isinstance(eps, float) and eps >= 0 and math.isfinite(eps)):
        raise CodegenError(f"eps must be a finite float >= 0, got {eps!r}")
    return eps
