"""k3c.quant against the OCP MX v1.0 rules written out directly (no torchao needed)."""
import math

import torch

from k3c.quant import E2M1_VALUES, e8m0_to_float, mxfp4_dequantize, mxfp4_quantize, mxfp8_dequantize, mxfp8_quantize


def _nearest_even_e2m1(v):
    """Brute force: nearest E2M1 magnitude to |v| (ties to the even code), saturating at 6; sign kept."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    a = v.abs().double().clamp(max=6.0)[..., None]
    dist = (a - grid).abs()
    best = dist.min(-1, keepdim=True).values
    cand = dist == best
    code = torch.where(cand.sum(-1) > 1, (cand & (torch.arange(8) % 2 == 0)).int().argmax(-1), cand.int().argmax(-1))
    return torch.copysign(grid[code], v.double())


def test_elements_round_to_nearest_even_and_saturate():
    gen = torch.Generator().manual_seed(0)
    for rule in ("floor", "rceil"):
        x = torch.randn(256, 64, generator=gen) * 3
        x[:, 0] = 6.0  # both rules: scale 2^0, so elements are x itself
        x[:, 1:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        x = x.clamp(-6, 6)
        p, s = mxfp4_quantize(x, rule)
        assert (s == 127).all()
        assert torch.equal(mxfp4_dequantize(p, s, torch.float64), _nearest_even_e2m1(x))


def test_scale_rules_match_the_formulas():
    amax = [1e-30, 0.0078125, 0.1, 0.75, 1.0, 5.99, 6.0, 6.01, 7.9, 8.0, 100.0, 3e30]
    x = torch.zeros(len(amax), 32)
    x[:, 5] = torch.tensor(amax)
    _, s_floor = mxfp4_quantize(x, "floor")
    _, s_rceil = mxfp4_quantize(x, "rceil")
    _, s8 = mxfp8_quantize(x, "floor")
    for i, a in enumerate(amax):
        a32 = float(torch.tensor(a, dtype=torch.float32))
        assert s_floor[i, 0] - 127 == math.floor(math.log2(a32)) - 2
        assert s8[i, 0] - 127 == math.floor(math.log2(a32)) - 8
        d = float(torch.tensor(a32, dtype=torch.float32) / 6)
        assert s_rceil[i, 0] - 127 == math.ceil(math.log2(d))


def test_layout_first_element_low_nibble():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([6.0, -0.5, 1.0, 3.0])  # codes 7, 9, 2, 5
    p, s = mxfp4_quantize(x)
    assert s.item() == 127 and p[0, 0].item() == 0x97 and p[0, 1].item() == 0x52
    assert e8m0_to_float(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8))[:4].tolist() == [
        2.0**-127, 2.0**-126, 1.0, 2.0**127]
    d, s = mxfp8_quantize(torch.full((1, 32), 448.0 * 4))
    assert s.item() == 127 + 10 - 8 + 0 and mxfp8_dequantize(d, s, torch.float32).eq(1792.0).all()
