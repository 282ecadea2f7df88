"""K3's published expert format: compressed-tensors `mxfp4-pack-quantized` (group 32).

Per quantized Linear (out_features N, in_features K), compressed-tensors (>= 0.20,
`compressors/mxfp4/base.py` -> `nvfp4/helpers.py::pack_fp4_to_uint8` / `unpack_fp4_from_uint8`,
`compressors/mx_utils.py::compress_mx_scale` / `decompress_mx_scale`) stores:

  weight_packed  uint8 [N, K/2]   byte j of row n = code(w[n, 2j]) | code(w[n, 2j+1]) << 4  (first element in the
                                  LOW nibble); code = index 0..7 of |v| in (0, .5, 1, 1.5, 2, 3, 4, 6), bit 3 = sign
  weight_scale   uint8 [N, K/32]  E8M0 biased exponent, value 2^(s-127)

That is exactly k3c's MXFP4 layout along the reduction (in_features) dimension, so both conversions are checks plus
a no-op on the bytes. Older exports that kept `weight_scale` as a float power of two (bf16/fp16/fp32) are accepted by
`unpack_compressed_tensors_mxfp4` and converted exactly.
"""
from __future__ import annotations

import torch

from .mx import BLOCK_SIZE

__all__ = ["pack_compressed_tensors_mxfp4", "unpack_compressed_tensors_mxfp4"]


def _float_scale_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    f = scale.to(torch.float32)
    bits = f.view(torch.int32)
    ex = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    ok = torch.isfinite(f) & (f > 0) & (((ex > 0) & (man == 0)) | ((ex == 0) & (man == (1 << 22))))
    if not bool(ok.all()):
        raise ValueError(
            "unpack_compressed_tensors_mxfp4: a float weight_scale must hold positive finite powers of two "
            "in [2^-127, 2^127]"
        )
    e = torch.where(ex == 0, 0, ex)  # 2^-127 is the fp32 subnormal with mantissa 2^22 -> E8M0 0
    if bool((e > 254).any()):
        raise ValueError("unpack_compressed_tensors_mxfp4: weight_scale above 2^127 is not an E8M0 value")
    return e.to(torch.uint8)


def _check(packed: torch.Tensor, scales: torch.Tensor, who: str) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"{who}: packed weights must be uint8, got {packed.dtype}")
    K = packed.shape[-1] * 2
    want = (*packed.shape[:-1], K // BLOCK_SIZE)
    if K % BLOCK_SIZE or tuple(scales.shape) != want:
        raise ValueError(
            f"{who}: scale shape {tuple(scales.shape)} does not fit packed shape {tuple(packed.shape)} with group "
            f"size {BLOCK_SIZE} (expected {want})"
        )


def unpack_compressed_tensors_mxfp4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors (`weight_packed` [..., N, K/2] uint8, `weight_scale` [..., N, K/32] uint8 E8M0 or float
    powers of two) -> k3c (packed, scales), the layout `mxfp4_quantize` returns and `mxfp4_dequantize` reads."""
    if weight_scale.dtype != torch.uint8:
        if not weight_scale.is_floating_point():
            raise TypeError(f"weight_scale must be uint8 (E8M0) or floating point, got {weight_scale.dtype}")
        weight_scale = _float_scale_to_e8m0(weight_scale)
    _check(weight_packed, weight_scale, "unpack_compressed_tensors_mxfp4")
    return weight_packed.contiguous(), weight_scale.contiguous()


def pack_compressed_tensors_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """k3c (packed, scales) -> compressed-tensors (`weight_packed` uint8, `weight_scale` uint8 E8M0)."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales must be uint8 E8M0, got {scales.dtype}")
    _check(packed, scales, "pack_compressed_tensors_mxfp4")
    return packed.contiguous(), scales.contiguous()


