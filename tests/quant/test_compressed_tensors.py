"""K3's published expert format (compressed-tensors `mxfp4-pack-quantized`, group 32) against the package itself."""
import logging

import pytest
import torch

from k3c.quant import (
    e8m0_to_float,
    mxfp4_dequantize,
    mxfp4_quantize,
    pack_compressed_tensors_mxfp4,
    unpack_compressed_tensors_mxfp4,
    unpack_fp4,
)

pytest.importorskip("compressed_tensors")
logging.getLogger("compressed_tensors").setLevel(logging.ERROR)
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale  # noqa: E402
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402

SCHEME = preset_name_to_scheme("MXFP4A16", ["Linear"])


def _expert(gen, n=48, k=256, dtype=torch.bfloat16):
    return (torch.randn(n, k, generator=gen) * 0.02 * torch.exp(torch.randn(n, 1, generator=gen))).to(dtype)


def test_nibble_order_and_codes_exhaustive():
    # all 256 byte values: compressed-tensors' unpacker yields (low nibble, high nibble) = (element 2j, 2j+1)
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    theirs = unpack_fp4_from_uint8(packed, 4, 128, dtype=torch.float32)
    ours = mxfp4_dequantize(packed, torch.full((4, 4), 127, dtype=torch.uint8), torch.float32)  # scale 2^0
    assert torch.equal(theirs.view(torch.int32), ours.view(torch.int32))  # -0.0 included (code 8)
    codes = unpack_fp4(packed)
    assert torch.equal(codes[:, 0::2], packed & 0xF) and torch.equal(codes[:, 1::2], packed >> 4)
    # and their packer re-packs our element values into our bytes
    assert torch.equal(pack_fp4_to_uint8(ours), packed)


def test_scales_e8m0():
    s = torch.arange(1, 255, dtype=torch.uint8)
    assert torch.equal(decompress_mx_scale(s).float(), e8m0_to_float(s))
    assert torch.equal(compress_mx_scale(e8m0_to_float(s), torch.uint8), s)


@pytest.mark.parametrize("rule", ("floor", "rceil"))
def test_compressor_roundtrip(rule):
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        w = _expert(gen)
        packed, scales = mxfp4_quantize(w, rule)
        wp, ws = pack_compressed_tensors_mxfp4(packed, scales)
        assert wp.dtype == ws.dtype == torch.uint8 and wp.shape == (48, 128) and ws.shape == (48, 8)
        # their decompressor reads our bytes and scales as the weight we dequantize
        dec = MXFP4PackedCompressor.decompress({"weight_packed": wp, "weight_scale": ws}, SCHEME)["weight"]
        assert torch.equal(dec.view(torch.int16), mxfp4_dequantize(packed, scales, dec.dtype).view(torch.int16))
        # their compressor, given our scales as floats, writes exactly our bytes and scales
        comp = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": e8m0_to_float(scales).to(w.dtype)}, SCHEME)
        assert torch.equal(comp["weight_packed"], packed) and torch.equal(comp["weight_scale"], scales)
        # and back into our layout
        p2, s2 = unpack_compressed_tensors_mxfp4(comp["weight_packed"], comp["weight_scale"])
        assert torch.equal(p2, packed) and torch.equal(s2, scales)


def test_expert_stack_and_float_scales():
    gen = torch.Generator().manual_seed(8)
    w = torch.stack([_expert(gen, 32, 128) for _ in range(4)])  # [E, N, K]
    packed, scales = mxfp4_quantize(w)
    wp, ws = pack_compressed_tensors_mxfp4(packed, scales)
    for e in range(4):
        dec = MXFP4PackedCompressor.decompress({"weight_packed": wp[e], "weight_scale": ws[e]}, SCHEME)["weight"]
        assert torch.equal(dec, mxfp4_dequantize(packed[e], scales[e], dec.dtype))
    # an export that kept weight_scale as float powers of two converts exactly (2^-127 subnormal included)
    s = scales.clone()
    s[0, 0, 0] = 0
    s[0, 0, 1] = 254
    for dt in (torch.float32, torch.bfloat16):
        _, s2 = unpack_compressed_tensors_mxfp4(packed, e8m0_to_float(s).to(dt))
        assert torch.equal(s2, s)
    with pytest.raises(ValueError, match="powers of two"):
        unpack_compressed_tensors_mxfp4(packed, e8m0_to_float(scales) * 1.5)
    with pytest.raises(ValueError, match="group size 32"):
        unpack_compressed_tensors_mxfp4(packed, scales[..., :1])
