"""torchao's MX reference (eager path) as the oracle for k3c.quant, plus the comparison rule shared by the tests."""
import logging

import pytest
import torch

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

logging.getLogger("torchao").setLevel(logging.ERROR)

MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
ELEM = {"fp4": torch.float4_e2m1fn_x2, "fp8": torch.float8_e4m3fn}
ELEM_MAX = {"fp4": 6.0, "fp8": 448.0}


def ref_quantize(x, rule, fmt):
    """torchao to_mx -> (scales uint8 [..., K/32], elements uint8: fp4 packed bytes [..., K/2] / fp8 bits [..., K])."""
    s, d = mx_tensor.to_mx(x.contiguous(), ELEM[fmt], 32, MODES[rule])
    return s.view(torch.uint8), d.view(torch.uint8)


def ref_dequantize(data_u8, scales_u8, fmt, dtype):
    d = data_u8 if fmt == "fp4" else data_u8.view(torch.float8_e4m3fn)
    return mx_tensor.to_dtype(d, scales_u8.view(torch.float8_e8m0fnu), ELEM[fmt], 32, dtype)


def _log2_rounding_blocks(x, fmt):
    """Blocks where torchao's eager RCEIL (ceil(torch.log2(amax/max)) in fp32) is off by one from the exact ceil:
    amax/max lies a few ulps above a power of two and fp32 log2 rounds down onto the integer."""
    amax = x.abs().reshape(*x.shape[:-1], -1, 32).amax(-1).float()
    d = amax / ELEM_MAX[fmt]
    lg = torch.log2(d)
    return torch.isfinite(lg) & (lg == torch.round(lg)) & (torch.exp2(lg) != d)


def compare(x, rule, fmt, ours_q, ours_dq, dtype=torch.float32):
    """Bit-exact comparison with torchao. Returns the number of blocks excused as the documented RCEIL log2-rounding
    class (asserting each is exactly that class: our exponent is torchao's + 1). Elements of NaN-scale blocks are
    not compared (they are don't-care; k3c zeroes them) but both sides must dequantize those blocks to NaN."""
    x = x.contiguous()
    data, scales = ours_q
    rs, rd = ref_quantize(x, rule, fmt)
    excused = torch.zeros_like(scales, dtype=torch.bool)
    if rule == "rceil":
        excused = _log2_rounding_blocks(x, fmt) & (scales != rs)
        assert torch.equal(scales[excused].int(), rs[excused].int() + 1)
    assert torch.equal(scales[~excused], rs[~excused]), "E8M0 scales differ from torchao"
    nan_blk = scales == 0xFF
    skip = nan_blk | excused
    per = 16 if fmt == "fp4" else 32
    ours_e = data.view(torch.uint8).reshape(*scales.shape, per)
    ref_e = rd.reshape(*scales.shape, per)
    bad = (ours_e != ref_e).any(-1) & ~skip
    assert not bad.any(), f"elements differ from torchao in {int(bad.sum())} blocks, e.g. {bad.nonzero()[0].tolist()}"
    # dequantized values, bit for bit (NaN blocks: NaN on both sides)
    rdq = ref_dequantize(rd, rs, fmt, dtype).reshape(*scales.shape, 32)
    odq = ours_dq.reshape(*scales.shape, 32)
    assert torch.isnan(odq[nan_blk]).all() and torch.isnan(rdq[nan_blk]).all()
    keep = ~skip
    ib = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(odq[keep].view(ib), rdq[keep].view(ib)), "dequantized values differ from torchao (bits)"
    return int(excused.sum())
