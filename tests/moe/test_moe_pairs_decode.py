"""The PTX of the bf16x2 pair decode (k3c.codegen.kernels.moe.E2M1_PAIRS_OPS, the "pairs" plans on sm_90), run op by
op in Python with PTX semantics (prmt byte select, u16x2 max, bf16x2 multiplies rounded to nearest even with
subnormals) on every packed byte and every E8M0 scale: each byte gives the bf16 pair k3c.quant.mxfp4_dequantize
gives, bit for bit (the interpreter cannot run inline PTX, so this is the numerics check of that path on a CPU)."""
from __future__ import annotations

import pytest
import torch

from k3c.codegen.kernels import moe as KM
from k3c.quant import mxfp4_dequantize

M32 = 0xFFFFFFFF


def _bf16x2_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mul.rn.bf16x2 on int64 words holding two bf16 lanes: each lane's exact product rounded once to bf16."""
    def lanes(x):
        lo = (x & 0xFFFF).to(torch.int16).view(torch.bfloat16)
        hi = ((x >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
        return lo.float(), hi.float()
    (al, ah), (bl, bh) = lanes(a), lanes(b)
    pl = (al * bl).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF   # fp32 product is exact
    ph = (ah * bh).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return pl | (ph << 16)


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert nib < 8, "sign-replicate mode is not used"
        out |= src[nib] << (8 * i)
    return out


def run_ops(ops, regs: dict) -> dict:
    regs = dict(regs)

    def val(x):
        return regs[x] if isinstance(x, str) else torch.full_like(regs["$4"], x & M32)
    for op, d, *src in ops:
        s = [val(x) for x in src]
        if op == "shl":
            r = (s[0] << src[1]) & M32
        elif op == "shr":
            r = s[0] >> src[1]
        elif op == "shfw":      # shf.r.wrap.b32 d, a, a, n: rotate right (bench/moe_forms.py's perm decode)
            r = (s[0] >> src[1]) | ((s[0] << (32 - src[1])) & M32)
        elif op == "and":
            r = s[0] & s[1]
        elif op == "or":
            r = s[0] | s[1]
        elif op == "mov":
            r = s[0]
        elif op == "mul":
            r = (s[0] * s[1]) & M32
        elif op == "mad":
            r = (s[0] * s[1] + s[2]) & M32
        elif op == "max16":
            r = torch.maximum(s[0] & 0xFFFF, s[1] & 0xFFFF) | (torch.maximum(s[0] >> 16, s[1] >> 16) << 16)
        elif op == "prmt":
            r = _prmt(s[0], s[1], src[2])
        elif op == "mulbf":
            r = _bf16x2_mul(s[0], s[1])
        else:
            raise AssertionError(f"op {op} has no model here")
        regs[d] = r & M32
    return regs


@pytest.mark.parametrize("ops, scales", [("E2M1_PAIRS_OPS", range(0, 64)), ("E2M1_PAIRS_OPS", range(64, 128)),
                                         ("E2M1_PAIRS_OPS", range(128, 192)), ("E2M1_PAIRS_OPS", range(192, 255)),
                                         ("E2M1_PAIRS1_OPS", range(0, KM.PAIRS1_MAX_SCALE + 1))])
def test_pairs_decode_equals_dequantize_bitwise(ops, scales):
    """Both decodes: the exact two-multiply one on every scale, the one-multiply one on the scales it is used for."""
    g = torch.Generator().manual_seed(0)
    s = torch.tensor(list(scales), dtype=torch.int64)
    # every byte value at every position of a word: words (b, b+1, b+2, b+3) for b in 0..255 and random words
    base = torch.arange(256, dtype=torch.int64)
    byts = torch.stack([(base + j) % 256 for j in range(4)], dim=1)
    byts = torch.cat([byts, torch.randint(0, 256, (256, 4), generator=g)])
    words = (byts << torch.tensor([0, 8, 16, 24])).sum(1)
    W, S = torch.meshgrid(words, s, indexing="ij")
    out = run_ops(getattr(KM, ops), {"$4": W.reshape(-1), "$5": S.reshape(-1)})
    got = torch.stack([out[f"${j}"] for j in range(4)], dim=1)                       # [n, 4] bf16x2 words
    got = torch.stack([got & 0xFFFF, got >> 16], dim=2).reshape(-1, 8)               # K order: 8 bf16 bit patterns
    packed = byts[:, None, :].expand(-1, len(s), -1).reshape(-1, 4).to(torch.uint8)
    # mxfp4_dequantize takes whole 32-blocks: 16 bytes per block, the word's 4 bytes repeated
    want = mxfp4_dequantize(packed.repeat(1, 4), S.reshape(-1, 1).to(torch.uint8), torch.bfloat16)[:, :8]
    want = want.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(got, want)


def test_pairs1_overflows_above_its_scale_range():
    """Why the runtime checks the scales before it takes the one-multiply decode: 2^(s - 1) is not a bf16 above."""
    out = run_ops(KM.E2M1_PAIRS1_OPS, {"$4": torch.tensor([0x22222222]), "$5": torch.tensor([KM.PAIRS1_MAX_SCALE + 1])})
    assert (out["$0"] & 0x7F80) == 0x7F80                          # inf, where the reference has 2^2


def test_pairs_asm_text_is_the_ops():
    for ops, text in ((KM.E2M1_PAIRS_OPS, KM.E2M1_PAIRS_ASM), (KM.E2M1_PAIRS1_OPS, KM.E2M1_PAIRS1_ASM)):
        assert text.count(";") == len(ops) + 1                      # the .reg line + one line per op
        assert "mul.rn.bf16x2" in text and "prmt.b32" in text
    assert "max.u16x2" in KM.E2M1_PAIRS_ASM and KM.E2M1_PAIRS1_ASM.count("mul.rn.bf16x2") == 4
