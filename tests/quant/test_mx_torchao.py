"""k3c.quant MXFP4 / MXFP8 against torchao's MX reference, bit for bit, for both scale rules."""
import math
import zlib

import pytest
import torch

from k3c.quant import mxfp4_dequantize, mxfp4_quantize, mxfp8_dequantize, mxfp8_quantize

from .mxref import compare, ref_dequantize, ref_quantize

RULES = ("floor", "rceil")
DTYPES = (torch.float32, torch.bfloat16)
FMTS = ("fp4", "fp8")


def _q(x, rule, fmt, dtype):
    if fmt == "fp4":
        q = mxfp4_quantize(x, rule)
        return q, mxfp4_dequantize(*q, dtype=dtype)
    q = mxfp8_quantize(x, rule)
    return q, mxfp8_dequantize(*q, dtype=dtype)


def _check(x, rule, fmt):
    q, dq = _q(x, rule, fmt, x.dtype)
    return compare(x, rule, fmt, q, dq, x.dtype)


def _random(kind, shape, gen):
    if kind == "normal":
        return torch.randn(shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen) * 2)
    if kind == "uniform":
        return torch.rand(shape, generator=gen) * 2 - 1
    # log-uniform magnitudes over 2^-60 .. 2^60 with random signs: every exponent, every mantissa
    mag = torch.exp2(torch.rand(shape, generator=gen) * 120 - 60)
    return torch.where(torch.rand(shape, generator=gen) < 0.5, -mag, mag)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ("normal", "uniform", "loguniform"))
def test_random_bit_exact(kind, rule, dtype, fmt):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{rule}-{dtype}-{fmt}".encode()))
    for shape in ((7, 96), (3, 5, 128), (64, 1024)):
        x = _random(kind, shape, gen).to(dtype)
        excused = _check(x, rule, fmt)
        assert excused == 0  # the RCEIL log2 class needs amax/max within ulps of a power of two: not hit here


# ---- adversarial inputs -------------------------------------------------------------------------------------------

def _blocks_with_amax(amax, rest):
    """One block per (amax, rest-row): element 0 = amax (pins the scale), elements 1.. = rest (len 31)."""
    rows = [torch.cat([torch.tensor([a], dtype=torch.float64), r.double()]) for a in amax for r in rest]
    return torch.stack(rows)


E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def test_e2m1_ties_every_midpoint():
    # amax = 6 * 2^j puts the E2M1 grid at 2^j (both rules: floor(log2 6) - 2 = 0 = ceil(log2(6/6))); every tie,
    # its fp32/bf16 neighbours, and the grid points themselves, with both signs, at many scales
    ties = torch.tensor(E2M1_MIDPOINTS + (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), dtype=torch.float64)
    for dtype in DTYPES:
        base = ties.to(dtype)
        up = torch.nextafter(base, torch.full_like(base, 100))
        dn = torch.nextafter(base, torch.full_like(base, -100))
        vals = torch.cat([base, up, dn, -base, -up, -dn]).double()
        vals = vals[(vals.abs() <= 6)]
        vals = torch.cat([vals, vals[: 31 - len(vals) % 31]]) if len(vals) % 31 else vals
        rows = vals.reshape(-1, 31)
        for j in (-100, -20, -3, 0, 1, 7, 60, 100):
            x = _blocks_with_amax([6.0], list(rows)) * 2.0**j
            x = x.to(dtype)
            for rule in RULES:
                _check(x, rule, "fp4")
                _check(x, rule, "fp8")
    # and the codes themselves: ties go to the even code
    x = torch.zeros(1, 32)
    x[0, 0] = 6.0
    x[0, 1:8] = torch.tensor(E2M1_MIDPOINTS)
    p, s = mxfp4_quantize(x)
    assert s.item() == 127
    got = mxfp4_dequantize(p, s, torch.float32)[0, 1:8].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_saturation_edge():
    # amax in [6, 8): FLOOR keeps scale 2^0 so 6.5, 7, 7.99 saturate to 6; RCEIL moves up a binade
    amaxes = [6.0, 6.0 + 2**-21, 6.25, 6.5, 7.0, 7.5, 7.999, 8.0, 8.0 - 2**-20, 12.0, 13.0, 14.0]
    gen = torch.Generator().manual_seed(1)
    rest = [torch.rand(31, generator=gen) * 12 - 6, torch.full((31,), 6.5), torch.full((31,), -7.0)]
    for dtype in DTYPES:
        for rule in RULES:
            for fmt in FMTS:
                x = _blocks_with_amax(amaxes, rest)
                if fmt == "fp8":
                    x = x * (448 / 6)
                _check(x.to(dtype), rule, fmt)
    p, s = mxfp4_quantize(torch.tensor([[7.0] + [6.5] * 31]), "floor")
    assert s.item() == 127 and (mxfp4_dequantize(p, s, torch.float32) == 6.0).all()
    p, s = mxfp4_quantize(torch.tensor([[7.0] + [6.5] * 31]), "rceil")
    d = mxfp4_dequantize(p, s, torch.float32)[0]  # scale 2: 7 / 2 = 3.5 -> 4 (tie to even), 6.5 / 2 = 3.25 -> 3
    assert s.item() == 128 and d[0] == 8.0 and (d[1:] == 6.0).all()


def test_amax_power_of_two_and_binade_edges():
    exps = list(range(-149, 128, 3)) + [-127, -126, -125, 125, 126, 127]
    gen = torch.Generator().manual_seed(2)
    for dtype in DTYPES:
        amax = [2.0**e for e in exps if (dtype == torch.float32 or e >= -133)]
        rest = [torch.rand(31, generator=gen) * 2 - 1]
        x = _blocks_with_amax(amax, rest)
        x = x * (x[:, :1].abs() / x[:, 1:].abs().amax(-1, keepdim=True).clamp(min=1e-300)).clamp(max=1)
        x = x.to(dtype)
        for rule in RULES:
            for fmt in FMTS:
                _check(x, rule, fmt)


def test_zero_and_negative_zero_blocks():
    x = torch.zeros(4, 64)
    x[1] = -0.0
    x[2, ::2] = -0.0
    x[3, 32:] = torch.linspace(-1, 1, 32)
    for dtype in DTYPES:
        for rule in RULES:
            for fmt in FMTS:
                _check(x.to(dtype), rule, fmt)
    p, s = mxfp4_quantize(x, "floor")
    assert (s[:3] == 0).all() and s[3, 0] == 0
    assert (p[1] == 0x88).all()  # -0.0 keeps its sign: code 8 in both nibbles
    assert (p[2] == 0x08).all()  # element 2j = -0.0 -> low nibble 8; element 2j+1 = +0.0 -> high nibble 0


def test_subnormal_inputs():
    gen = torch.Generator().manual_seed(3)
    # fp32 subnormals (2^-149 .. 2^-126), mixed with tiny normals; bf16 subnormals (2^-133 .. 2^-126)
    m32 = torch.exp2(-126 - torch.rand(8, 64, generator=gen) * 23)
    m32[0, :32] = 2.0**-149
    m32[1, :32] = 2.0**-127 * 6  # amax at the RCEIL exponent-0 edge
    m32[1, 32:] = 2.0**-127 * 6.0000005
    m32[2, :32] = 2.0**-126 * 1.5  # FLOOR: scale code 0 (2^-127) but torchao divides by 2^-126
    x32 = m32 * torch.where(torch.rand(8, 64, generator=gen) < 0.5, -1.0, 1.0)
    xb = (torch.exp2(-126 - torch.rand(8, 64, generator=gen) * 7) * torch.sign(torch.randn(8, 64, generator=gen)))
    for x in (x32, xb.to(torch.bfloat16)):
        for rule in RULES:
            for fmt in FMTS:
                _check(x, rule, fmt)


def test_inf_nan():
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(4))
    x[0, 3] = float("inf")
    x[1, 5] = -float("inf")
    x[2, 7] = float("nan")
    x[3, 0] = float("nan")
    x[3, 1] = float("inf")
    x[4, :32] = float("inf")
    x[5, 40] = -float("nan")
    x[6, :] = float("nan")
    x[7, 33] = 3.0e38  # finite, near fp32 max
    x[8, 0] = -torch.finfo(torch.float32).max
    for dtype in DTYPES:
        for rule in RULES:
            for fmt in FMTS:
                _check(x.to(dtype), rule, fmt)
    p, s = mxfp4_quantize(x, "floor")
    assert s[2, 0] == 0xFF and s[3, 0] == 0xFF and s[5, 1] == 0xFF and (s[6] == 0xFF).all()
    assert (p.reshape(10, 2, 16)[s == 0xFF] == 0).all()  # documented: elements of a NaN block are code 0
    assert s[0, 0] == 253 and s[1, 0] == 253  # FLOOR: inf amax -> exponent bits 255 - 127 - 2 = 126 -> 2^126
    assert torch.isnan(mxfp4_dequantize(p, s, torch.float32)[2, :32]).all()
    p, s = mxfp4_quantize(x, "rceil")
    assert s[0, 0] == 254 and s[2, 0] == 0xFF  # RCEIL: inf amax -> 254 (satfinite), NaN -> 255
    d, s8 = mxfp8_quantize(x, "floor")
    assert s8[0, 0] == 247 and d[0, 3].float().item() == 448.0  # inf saturates to the element max


def test_float16_input_matches_float32():
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(5)).half()
    for rule in RULES:
        a, b = mxfp4_quantize(x, rule), mxfp4_quantize(x.float(), rule)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        a, b = mxfp8_quantize(x, rule), mxfp8_quantize(x.float(), rule)
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def _same_bits(a, b, dtype):
    ib = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(torch.nan_to_num(a).view(ib), torch.nan_to_num(b).view(ib))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_exhaustive(dtype):
    # every byte value (fp4: all 256 nibble pairs; fp8: all 256 E4M3 codes) under every E8M0 scale 0..255
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row r: bytes 0..255
    s4 = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 16).contiguous()  # K = 512: 16 blocks of scale r
    _same_bits(mxfp4_dequantize(codes, s4, dtype), ref_dequantize(codes, s4, "fp4", dtype), dtype)
    s8 = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 8).contiguous()  # K = 256: 8 blocks
    _same_bits(mxfp8_dequantize(codes, s8, dtype), ref_dequantize(codes, s8, "fp8", dtype), dtype)


def test_rceil_exact_ceil_where_torchao_log2_rounds():
    # amax/6 just above 2^k: the exact rule (cuBLAS, sm_100 cvt.rp.satfinite.ue8m0x2.f32) takes exponent k+1;
    # torchao's eager fallback computes ceil(torch.log2(amax/6)) in fp32, whose log2 rounds onto k for |k| >~ 2.
    ks = [-40, -20, -6, 5, 20, 40]
    for fmt, emax in (("fp4", 6.0), ("fp8", 448.0)):
        d = torch.tensor([2.0**k for k in ks])
        d = torch.nextafter(d, torch.full_like(d, math.inf))
        amax = d * emax
        above = amax / emax > 2.0 ** torch.tensor(ks, dtype=torch.float32)  # after the fp32 division too
        amax = torch.where(above, amax, torch.nextafter(amax, amax * 2))
        x = amax[:, None] * torch.linspace(1, 0.1, 32)[None, :]
        q, dq = _q(x, "rceil", fmt, torch.float32)
        scales = q[1]
        assert torch.equal(scales.flatten().int(), torch.tensor(ks, dtype=torch.int32) + 1 + 127)
        rs, _ = ref_quantize(x, "rceil", fmt)
        excused = compare(x, "rceil", fmt, q, dq)
        assert excused == int((rs.flatten() != scales.flatten()).sum()) and excused >= 4
        # exact ceil keeps the block inside the element range (no saturation of amax)
        assert (dq.abs().amax(-1) >= amax * 0.5).all()


def test_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_quantize(torch.randn(33))
    with pytest.raises(ValueError, match="rule"):
        mxfp4_quantize(torch.randn(4, 32), rule="even")
    with pytest.raises(TypeError):
        mxfp4_quantize(torch.randint(0, 3, (4, 32)))
    p, s = mxfp4_quantize(torch.randn(4, 64))
    with pytest.raises(ValueError):
        mxfp4_dequantize(p, s[:, :1])
    # 1-D and batched leading dims work; shapes follow the last dim
    p, s = mxfp4_quantize(torch.randn(2, 3, 4, 64))
    assert p.shape == (2, 3, 4, 32) and s.shape == (2, 3, 4, 2) and p.dtype == s.dtype == torch.uint8
    d, s = mxfp8_quantize(torch.randn(64))
    assert d.shape == (64,) and d.dtype == torch.float8_e4m3fn and s.shape == (2,)
