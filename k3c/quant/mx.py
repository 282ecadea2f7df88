"""OCP Microscaling (MX v1.0) formats: MXFP4 (E2M1) weights and MXFP8 (E4M3) activations.

Blocks of 32 consecutive elements along the LAST dimension (the reduction dimension) share one E8M0 scale
(uint8, value 2^(s-127), 0xFF = NaN). Everything here is vectorised torch and bit-exact with torchao's MX
reference (`torchao.prototype.mx_formats.mx_tensor.to_mx` / `to_dtype`, eager path) for both scale rules, with the
exceptions that docs/quant.md lists (elements of NaN-scale blocks; RCEIL where torchao's fp32 log2 rounds).

Scale rules (`rule=`):
  "floor"  OCP rule, torchao ScaleCalculationMode.FLOOR: e = floor(log2(amax)) - emax_elem, computed exactly from
           the fp32 exponent bits of amax (emax_elem = 2 for E2M1, 8 for E4M3); clamped to [-127, 128].
           Elements are x / 2^e, saturated to the element max (+-6 / +-448).
  "rceil"  cuBLAS / triton_kernels / aiter / sm_100 `cvt.rp.satfinite.ue8m0x2.f32`, torchao RCEIL:
           e = ceil(log2(amax / elem_max)) with amax / elem_max rounded to fp32 and the ceil computed EXACTLY from
           its bits; clamped to [-127, 127]; inf amax -> 254, NaN amax -> 255.
"""
from __future__ import annotations

import torch

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "E8M0_NAN",
    "RULES",
    "e8m0_to_float",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "pack_fp4",
    "unpack_fp4",
]

BLOCK_SIZE = 32
RULES = ("floor", "rceil")
E8M0_BIAS = 127
E8M0_NAN = 0xFF
F4_MAX, F4_EMAX = 6.0, 2  # E2M1: largest value 6 = 1.5 * 2^2
F8_MAX, F8_EMAX = 448.0, 8  # E4M3 (fn): largest value 448 = 1.75 * 2^8
F32_MIN_NORMAL = 2.0**-126
#: the 8 non-negative E2M1 magnitudes, indexed by the 3 low bits of a code (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_SIGNED = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)  # code 8 is -0.0
# round-to-nearest-even thresholds on |x|: code = #(|x| > t) for ties going down, #(|x| >= t) for ties going up
# (the upper neighbour's code is even: 0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0; 0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2.0,
# 5.0 -> 4.0)
_F4_GT = (0.25, 1.25, 2.5, 5.0)
_F4_GE = (0.75, 1.75, 3.5)
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_input(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{what}: input dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: input must have at least one dimension (blocks run along the last one)")
    if x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"{what}: the last (reduction) dimension must be a multiple of {BLOCK_SIZE}, got shape "
            f"{tuple(x.shape)}; pad it with zeros to a multiple of {BLOCK_SIZE} first (zero padding leaves "
            f"every block's scale unchanged and dequantizes to zeros)"
        )


def _check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown MX scale rule {rule!r}; expected one of {RULES}")
    return rule


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def _scale_and_scaled(xb: torch.Tensor, rule: str, elem_max: float, elem_emax: int):
    """Per-block E8M0 scale (uint8 [..., nb]) and the fp32 elements to be cast ([..., nb, 32], not yet saturated
    for E2M1). amax is taken in the input dtype (as torchao does), then widened to fp32."""
    amax = xb.abs().amax(dim=-1, keepdim=True).to(torch.float32)  # NaN propagates
    x32 = xb.to(torch.float32)
    isnan = torch.isnan(amax)
    if rule == "floor":
        bits = amax.view(torch.int32)
        e = ((bits >> 23) & 0xFF) - 127 - elem_emax  # exact floor(log2) for normals; subnormal amax -> -127 - emax
        e = torch.clamp(e, -E8M0_BIAS, E8M0_BIAS + 1)  # inf amax -> 128 - emax (finite scale), NaN handled below
        scale = torch.where(isnan, E8M0_NAN, e + E8M0_BIAS).to(torch.uint8)
        # divide by 2^(s-127), the divisor clamped to the smallest normal fp32 (torchao does this: s = 0 blocks
        # are scaled by 2^-126, not 2^-127); s = 255 divides by inf
        div = (scale.to(torch.int32) << 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)
        scaled = x32 / div
    else:
        descale = amax / elem_max
        bits = descale.view(torch.int32)
        ex = (bits >> 23) & 0xFF
        man = bits & 0x7FFFFF
        # exact ceil(log2(descale)): normal -> (ex - 127) + (mantissa != 0); zero/subnormal -> <= -126, and the
        # clamp at -127 only needs to know whether descale > 2^-127 (mantissa > 2^22)
        e = torch.where(ex == 0, torch.where(man > (1 << 22), -126, -127), ex - 127 + (man != 0).to(torch.int32))
        e = torch.clamp(e, -E8M0_BIAS, E8M0_BIAS)
        scale = torch.where(isnan, E8M0_NAN, torch.where(torch.isinf(descale), 254, e + E8M0_BIAS))
        scale = scale.to(torch.uint8)
        si = scale.to(torch.int32)
        # reciprocal 2^(127-s); s = 0 multiplies by 1.0 (torchao / TransformerEngine), s = 255 by NaN
        rcp = ((254 - si).clamp(min=1) << 23).view(torch.float32)
        rcp = torch.where(si == 254, 2.0**-127, rcp)
        rcp = torch.where(si == 0, 1.0, rcp)
        rcp = torch.where(si == E8M0_NAN, float("nan"), rcp)
        scaled = x32 * rcp
    return scale.squeeze(-1), scaled, isnan


def _f32_to_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit E2M1 codes (uint8 0..15): round to nearest even, saturate at +-6 (inf -> +-6), sign kept
    (also for -0.0 and values that round to zero). NaN -> magnitude code 0."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t in _F4_GT:
        code += (a > t).to(torch.uint8)
    for t in _F4_GE:
        code += (a >= t).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., K] (uint8, 0..15) -> bytes [..., K/2]: element 2j in the LOW nibble, 2j+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dimension must be even, got {tuple(codes.shape)}")
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] -> 4-bit codes [..., K] (inverse of pack_fp4)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4: packed must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 -> fp32 2^(s-127) (s = 0 gives the subnormal 2^-127), 0xFF -> NaN."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scales.dtype}")
    si = scales.to(torch.int32)
    f = (si << 23).view(torch.float32)
    f = torch.where(si == 0, 2.0**-127, f)
    return torch.where(si == E8M0_NAN, float("nan"), f)


def mxfp4_quantize(w: torch.Tensor, rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `w` [..., K] (fp32/bf16/fp16, K % 32 == 0) to MXFP4 along the last dimension.

    Returns (packed uint8 [..., K/2], scales uint8 E8M0 [..., K/32]). Elements are E2M1 codes (bit 3 = sign,
    bits 0-2 index E2M1_VALUES), rounded to nearest even and saturated at +-6; two per byte, first in the low
    nibble. A block containing NaN gets scale 0xFF and all element codes 0.
    """
    _check_input(w, "mxfp4_quantize")
    rule = _check_rule(rule)
    scale, scaled, isnan = _scale_and_scaled(_blocks(w), rule, F4_MAX, F4_EMAX)
    codes = _f32_to_e2m1_codes(scaled)
    codes = codes.masked_fill(isnan, 0)
    return pack_fp4(codes.reshape(w.shape)), scale


def mxfp4_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 (packed [..., K/2] uint8, scales [..., K/32] uint8) -> dense [..., K] in `dtype`.

    Computed as torchao does: E2M1 value cast to `dtype`, times the scale cast to `dtype` (so fp16 over/underflows
    the way a cast does); a 0xFF block is NaN."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"mxfp4_dequantize: packed must be uint8, got {packed.dtype}")
    K = packed.shape[-1] * 2
    if K % BLOCK_SIZE or tuple(scales.shape) != (*packed.shape[:-1], K // BLOCK_SIZE):
        raise ValueError(
            f"mxfp4_dequantize: scales shape {tuple(scales.shape)} does not match packed {tuple(packed.shape)} "
            f"(expected {(*packed.shape[:-1], K // BLOCK_SIZE)})"
        )
    lut = torch.tensor(_E2M1_SIGNED, dtype=torch.float32, device=packed.device)
    vals = lut[unpack_fp4(packed).long()].to(dtype)
    s = e8m0_to_float(scales).to(dtype).unsqueeze(-1)
    return (_blocks(vals) * s).reshape(vals.shape)


def mxfp8_quantize(x: torch.Tensor, rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` [..., K] to MXFP8 E4M3 along the last dimension (blocks of 32, emax 8 for the FLOOR rule).

    Returns (data torch.float8_e4m3fn [..., K], scales uint8 E8M0 [..., K/32]). Elements saturate at +-448 and
    round to nearest even (torch's cast); a block containing NaN gets scale 0xFF and all elements +0."""
    _check_input(x, "mxfp8_quantize")
    rule = _check_rule(rule)
    scale, scaled, isnan = _scale_and_scaled(_blocks(x), rule, F8_MAX, F8_EMAX)
    scaled = torch.clamp(scaled, -F8_MAX, F8_MAX).masked_fill(isnan, 0.0)
    return scaled.to(torch.float8_e4m3fn).reshape(x.shape), scale


def mxfp8_dequantize(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP8 (data float8_e4m3fn [..., K] or its uint8 bits, scales uint8 [..., K/32]) -> dense [..., K]."""
    if data.dtype == torch.uint8:
        data = data.view(torch.float8_e4m3fn)
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"mxfp8_dequantize: data must be float8_e4m3fn (or uint8 bits), got {data.dtype}")
    K = data.shape[-1]
    if K % BLOCK_SIZE or tuple(scales.shape) != (*data.shape[:-1], K // BLOCK_SIZE):
        raise ValueError(
            f"mxfp8_dequantize: scales shape {tuple(scales.shape)} does not match data {tuple(data.shape)}"
        )
    vals = data.to(dtype)
    s = e8m0_to_float(scales).to(dtype).unsqueeze(-1)
    return (_blocks(vals) * s).reshape(vals.shape)
