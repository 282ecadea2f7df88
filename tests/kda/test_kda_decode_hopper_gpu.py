"""The hopper tier's KDA decode step (k3c/codegen/kernels/kda_decode_hopper.py) and prep (kda_prep_hopper.py) through
the runtime on a GPU:
binaries compiled ahead of time by the Triton its Gluon source is written for, bound to the device, then
`kda_decode` with the hopper plan against the portable plan on the same inputs (which tests/kda/test_kda_kernels.py
checks against the torch recurrence): the fp32 o or the fused y, the state (in place and out of place) and the conv
tails (bit-exact: they are copies); the prep's q, k, v, g, beta rows and new tails against the portable prep's.

The GPU machine's Triton may not build the Gluon source, so the binaries come from a folder built elsewhere; the
folder also holds the variants bench/kda.py times (`--hopper-bin`):

    python tests/kda/test_kda_decode_hopper_gpu.py build .hopper-kda                   # here (Triton 3.9)
    K3C_HOPPER_KDA_BIN=.hopper-kda python -m pytest -q tests/kda/test_kda_decode_hopper_gpu.py   # on the GPU

Without K3C_HOPPER_KDA_BIN the test compiles them itself where this Triton can (tiers.can_build)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from k3c.codegen.aot import CompiledKernel, compile_kernels
from k3c.codegen.kernels.kda import kda_plan
from k3c.codegen.kernels.kda_decode_hopper import emit_kda_decode_hopper
from k3c.codegen.kernels.kda_prep_hopper import emit_kda_prep_hopper
from k3c.codegen.targets import get_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D, KW, LB = 128, 4, -5.0
EPS = dict(l2norm_eps=1e-6, norm_eps=1e-5)
# (decode_block_v, decode_warps, decode_lanes_k): the ones bench/kda.py times; the first is what the tests run
VARIANTS = [(32, 4, 8), (32, 4, 32), (64, 4, 8), (64, 8, 8), (64, 8, 32)]
BENCH_HEADS = (12, 96)
CASES = [(3, 2, "bf16", "safe"), (5, 12, "fp32", "safe"), (2, 96, "bf16", "softplus")]   # (B, H, dtype, gate)
PREP_BLOCKS = (32, 64)            # the prep's tokens a program: the cases run the first, bench/kda.py times both
PREP_CASES = [([1, 2, 70, 33], 2, "bf16", "safe"), ([5, 130], 12, "fp32", "softplus"), ([300], 96, "bf16", "safe")]


def plan_of(target, dtype: str, variant=VARIANTS[0]):
    bv, w, lk = variant
    return kda_plan(D, dtype, target, decode_tier="hopper", decode_block_v=bv, decode_warps=w, decode_lanes_k=lk)


def kernels(target) -> list:
    """The cases' kernels (the first variant, both outputs) and bench/kda.py's (every variant, bf16, safe gate)."""
    out = {}

    def add(h, dtype, gate, variant, fuse_out):
        ks = emit_kda_decode_hopper(h, D, KW, gate=gate, gate_lower_bound=LB, target=target, dtype=dtype,
                                    plan=plan_of(target, dtype, variant), fuse_out=fuse_out, **EPS)
        out[ks.key] = ks

    for _, h, dtype, gate in CASES:
        for fuse_out in (True, False):
            add(h, dtype, gate, VARIANTS[0], fuse_out)
    for h in BENCH_HEADS:
        for variant in VARIANTS:
            for fuse_out in (True, False):
                add(h, "bf16", "safe", variant, fuse_out)

    def add_prep(h, dtype, gate, block_t):
        ks = emit_kda_prep_hopper(h, D, KW, gate=gate, gate_lower_bound=LB, l2norm_eps=EPS["l2norm_eps"],
                                  target=target, dtype=dtype, qkv_dtype=dtype, block_t=block_t)
        out[ks.key] = ks

    for _, h, dtype, gate in PREP_CASES:
        add_prep(h, dtype, gate, PREP_BLOCKS[0])
    for block_t in PREP_BLOCKS:
        add_prep(96, "bf16", "safe", block_t)          # bench/kda.py's headline
    return list(out.values())


def build(out_dir: str, target_name: str = "h200") -> list[CompiledKernel]:
    target = get_target(target_name)
    compiled = compile_kernels(kernels(target), target, out_dir, progress=False)
    with open(os.path.join(out_dir, "kernels.json"), "w", encoding="utf-8") as f:
        json.dump([ck.to_dict() for ck in compiled], f)
    return compiled


def binding_from(root: str, target):
    """A Binding over the folder's binaries ("artifact" policy: the portable kernels beside them JIT-compile)."""
    from k3c.runtime import launcher

    with open(os.path.join(root, "kernels.json"), encoding="utf-8") as f:
        compiled = [CompiledKernel.from_dict(d) for d in json.load(f)]
    return launcher.Binding(launcher.Catalogue(target, os.path.abspath(root),
                                               {ck.catalogue_key: ck for ck in compiled}), target, "artifact")


@pytest.fixture(scope="module")
def bound(tmp_path_factory):
    from k3c.codegen import tiers
    from k3c.runtime.devices import target_for

    dev = torch.device("cuda", torch.cuda.current_device())
    target = target_for(dev)
    if not target.has_tier("hopper"):
        pytest.skip(f"{target.name} has no hopper tier")
    root = os.environ.get("K3C_HOPPER_KDA_BIN")
    if not root:
        if not all(tiers.can_build(ks) for ks in kernels(target)):
            pytest.skip("this Triton cannot build the hopper tier's source: set K3C_HOPPER_KDA_BIN (module doc)")
        root = str(tmp_path_factory.mktemp("hopper_kda"))
        build(root, target.name)
    return dev, binding_from(root, target)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}_H{c[1]}_{c[2]}_{c[3]}")
def test_hopper_decode_matches_the_portable_one(bound, case):
    from k3c.runtime.kernel_impls.kda import kda_decode

    dev, binding = bound
    B, H, dtype, gate = case
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    gen = torch.Generator(device=dev).manual_seed(B * 100 + H)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale)

    x = [rnd(B, H * D).to(dt) for _ in range(4)]
    xb, xg = rnd(B, H).to(dt), rnd(B, H * D).to(dt)
    conv = [rnd(H * D, 1, KW, scale=0.5).to(dt) for _ in range(3)]
    a_log = torch.linspace(-0.7, 2.0, H, device=dev)
    dt_bias = rnd(H * D) - 1.0
    nw = rnd(D) * 0.1 + 1.0
    tails = [rnd(B, H * D, KW - 1).to(dt) for _ in range(3)]
    s0 = rnd(B, H, D, D, scale=0.5)
    kw = dict(num_heads=H, head_dim=D, gate=gate, gate_lower_bound=LB, **EPS)
    hop = dict(decode_tier="hopper", decode_block_v=VARIANTS[0][0], decode_warps=VARIANTS[0][1],
               decode_lanes_k=VARIANTS[0][2], binding=binding)
    for fuse_out in (False, True):
        g, n = (xg, nw) if fuse_out else (None, None)
        want_y, want_t, want_s = kda_decode(*x, xb, g, conv, a_log, dt_bias, n, tails, s0, fuse_out=fuse_out, **kw)
        got_y, got_t, got_s = kda_decode(*x, xb, g, conv, a_log, dt_bias, n, tails, s0, fuse_out=fuse_out, **kw,
                                         **hop)
        assert got_y.dtype == want_y.dtype and torch.isfinite(got_y).all()
        assert rel(got_y, want_y) < (1e-5 if dtype == "fp32" and not fuse_out else 5e-3), fuse_out
        assert rel(got_s, want_s) < 1e-5
        assert all(torch.equal(a, b) for a, b in zip(got_t, want_t))
        # in place, the runtime's decode step: the tails and the state are read and written by the same program
        s_in, t_in = s0.clone(), [t.clone() for t in tails]
        y_ip, t_ip, s_ip = kda_decode(*x, xb, g, conv, a_log, dt_bias, n, t_in, s_in, fuse_out=fuse_out, inplace=True,
                                      **kw, **hop)
        assert s_ip is s_in and torch.equal(s_in, got_s) and torch.equal(y_ip, got_y)
        assert all(a is b and torch.equal(a, c) for a, b, c in zip(t_ip, t_in, want_t))


@pytest.mark.parametrize("case", PREP_CASES, ids=lambda c: f"N{len(c[0])}_H{c[1]}_{c[2]}_{c[3]}")
def test_hopper_prep_matches_the_portable_one(bound, case):
    from k3c.runtime.kernel_impls.kda import cu_seqlens, kda_prep, unpack

    dev, binding = bound
    lengths, H, dtype, gate = case
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    gen = torch.Generator(device=dev).manual_seed(sum(lengths) + H)
    total, N = sum(lengths), len(lengths)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=dev) * scale

    x = [rnd(total, H * D).to(dt) for _ in range(4)]
    xb = rnd(total, H).to(dt)
    conv = [rnd(H * D, 1, KW, scale=0.5).to(dt) for _ in range(3)]
    a_log, dt_bias = torch.linspace(-0.7, 2.0, H, device=dev), rnd(H * D) - 1.0
    tails = [rnd(N, H * D, KW - 1).to(dt) for _ in range(3)]
    kw = dict(num_heads=H, head_dim=D, gate=gate, gate_lower_bound=LB, l2norm_eps=EPS["l2norm_eps"],
              max_len=max(lengths), qkv_dtype=dt, block_t=PREP_BLOCKS[0])
    cu = cu_seqlens(lengths, dev)
    want, want_t = kda_prep(*x, xb, conv, a_log, dt_bias, tails, cu, **kw)
    got, got_t = kda_prep(*x, xb, conv, a_log, dt_bias, tails, cu, tier="hopper", binding=binding, **kw)
    for name, g, w_ in zip("q k v g beta".split(), unpack(got, H, D), unpack(want, H, D)):
        assert rel(g, w_) < (1e-5 if dtype == "fp32" or name in ("g", "beta") else 1e-2), name
    assert all(torch.equal(a, b) for a, b in zip(got_t, want_t))


def test_the_hopper_kernels_came_from_binaries(bound):
    from k3c.runtime import launcher

    assert launcher.stats().binaries >= 1 and launcher.stats().tier_fallbacks == []


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "build":
    for ck in build(sys.argv[2]):
        print(f"{ck.name} ({ck.tier}): {ck.resources.regs_text()} regs, spills {ck.resources.spill_count}")
