"""The Hopper-tier KDA state passing (k3c/codegen/kernels/kda_hopper.py, Gluon): it compiles ahead of time for sm_90a
through compile_kernels into spill-free binaries whose PTX multiplies on mma.sync (no wgmma), reads the chunk's
shared operands by ldmatrix from a cp.async ring and holds one CTA barrier per chunk (the products' chain has none);
it keeps the portable kernel's runtime contract (signature, grid) so a plan swaps the two; KDAPlan.inter_tier is
opt-in and refuses targets and shapes the kernel does not serve. Numerics run on the GPU
(tests/kda/test_kda_hopper_gpu.py, bench/kda_hopper.py)."""
from __future__ import annotations

import re

import pytest

from k3c.codegen.aot import compile_kernels
from k3c.codegen.kernels.kda import emit_kda_inter, kda_plan
from k3c.codegen.kernels.kda_hopper import K_SPLIT, emit_kda_inter_hopper
from k3c.codegen.targets import get_target
from k3c.codegen.writer import CodegenError

H, D = 96, 128


@pytest.fixture(scope="module")
def compiled(aot_dir):
    t = get_target("h200")
    kernels = [emit_kda_inter(H, D, target=t, v_dtype="bf16", o_dtype="bf16", has_initial_state=s0,
                              plan=kda_plan(D, "bf16", t, inter_tier="hopper", block_v=bv, inter_k_split=nk))
               for bv, s0, nk in ((64, True, None), (64, False, 1), (128, True, None), (32, True, None),
                                  (128, False, 1))]
    cks = compile_kernels(kernels, t, str(aot_dir / "out"), progress=False, keep_asm=True)
    return kernels, cks, aot_dir / "out"


def test_compiles_for_sm90a_spill_free_on_mma_sync(compiled):
    kernels, cks, out = compiled
    for ks, ck in zip(kernels, cks):
        res = ck.resources
        print(f"{ck.name}: {res.regs} registers, spills {res.spill_count}, shared {res.shared_bytes} B")
        assert ck.tier == "hopper" and ks.tier == "hopper" and ks.builds_with == "3.9"
        assert not res.has_spills and res.scratch_bytes == 0, res
        assert 0 < res.regs <= 255
        ptx = (out / ck.files["ptx"]).read_text()
        assert ".target sm_90a" in ptx and "wgmma" not in ptx
        # the chunk body twice (the loop is unrolled by two over the ring's stages), nothing else: per chunk X^T
        # 8 k-steps x 2 n-tiles, Vn^T 2, O^T 16 + 2, S^T 16 n-tiles of m16n8k16 (over all K parts)
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)) == 2 * 52
        assert len(re.findall(r"ldmatrix\.sync", ptx)) == 2 * 24       # K e^G^T, Q e^G^T (trans), K_d
        assert len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)) > 0
        # a barrier per chunk and one after the loop, none between the products: no layout conversion goes
        # through shared memory (only cp.async writes it)
        assert len(re.findall(r"bar\.sync", ptx)) == 3
        assert "st.shared" not in ptx
        assert ck.metadata["num_warps"] == ks.num_warps == ks.constexprs["BV"] // 16


def test_same_runtime_contract_as_the_portable_kernel():
    t = get_target("h100")
    port = emit_kda_inter(H, D, target=t, v_dtype="bf16", o_dtype="bf16", plan=kda_plan(D, "bf16", t))
    hop = emit_kda_inter(H, D, target=t, v_dtype="bf16", o_dtype="bf16",
                         plan=kda_plan(D, "bf16", t, inter_tier="hopper"))
    assert list(hop.signature.items()) == list(port.signature.items())
    assert hop.grid == port.grid == ("D // BV", "N * H")
    assert hop.constexprs == port.constexprs
    assert hop.name == f"k3c_kda_inter_hopper_h96_d128_bt16_bv64_w4_k{K_SPLIT}_vbf16_obf16"
    assert hop.source.startswith(f"# k3c generated Triton kernel: {hop.name}")
    assert "@gluon.jit" in hop.source and "IR op: kda_inter" in hop.source
    assert port.tier == "portable" and hop.tier == "hopper"


def test_the_portable_tier_stays_the_default():
    for name in ("h100", "h200", "mi355x"):
        p = kda_plan(D, "bf16", get_target(name))
        assert p.inter_tier == "portable" and p.inter_k_split == 1
    hop = kda_plan(D, "bf16", get_target("h200"), inter_tier="hopper")
    assert (hop.block_v, hop.chunk_warps, hop.inter_k_split) == (64, 4, K_SPLIT)


@pytest.mark.parametrize("kw, what", [
    (dict(target="mi355x"), "has no hopper tier"),
    (dict(target="cpu"), "has no hopper tier"),
    (dict(dtype="fp32"), "bf16 products"),
    (dict(dot="tf32"), "bf16 products"),
    (dict(chunk=32), "16-token chunks"),
    (dict(block_v=64, chunk_warps=2), "block_v = 16 x warps"),
    (dict(block_v=128, chunk_warps=4), "block_v = 16 x warps"),
    (dict(chunk_warps=3, block_v=48), "power of two"),
    (dict(head_dim=256), "head_dim a power of two in [16, 128]"),
    (dict(inter_tier="blackwell"), "inter_tier must be one of ('portable', 'hopper')"),
    (dict(inter_k_split=4), "k_split in (1, 2)"),
    (dict(head_dim=16, block_v=16, inter_k_split=2), "head_dim / k_split >= 16"),
    (dict(inter_tier=None, inter_k_split=2), "hopper-tier option"),
])
def test_the_plan_option_refuses_what_the_kernel_does_not_serve(kw, what):
    args = dict(head_dim=D, dtype="bf16", target="h200", inter_tier="hopper")
    args.update(kw)
    with pytest.raises(CodegenError, match=re.escape(what)):
        kda_plan(args.pop("head_dim"), args.pop("dtype"), get_target(args.pop("target")), **args)


def test_the_emitter_refuses_what_it_does_not_serve():
    t = get_target("h200")
    with pytest.raises(CodegenError, match="sm_90 cuda target"):
        emit_kda_inter_hopper(H, D, target=get_target("mi355x"))
    with pytest.raises(CodegenError, match="block_v = 16 x warps"):
        emit_kda_inter_hopper(H, D, target=t, block_v=64, warps=8)
    with pytest.raises(CodegenError, match="interpreter"):
        emit_kda_inter(H, D, target=t, plan=kda_plan(D, "bf16", t, inter_tier="hopper"), interpret=True)


def test_the_gpu_test_and_the_bench_build_what_their_runs_launch():
    """`build` of tests/kda/test_kda_hopper_gpu.py and bench/kda_hopper.py: the kernels of every plan they run, for
    h200 and h100 alike (same keys: a folder built for one serves the other under the strict binding)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path, n_hopper in (("tests/kda/test_kda_hopper_gpu.py", 5), ("bench/kda_hopper.py", 6)):
        spec = importlib.util.spec_from_file_location(f"_k3c_{Path(path).stem}", root / path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        built = mod.kernels(get_target("h200"))
        assert {ks.key for ks in built} == {ks.key for ks in mod.kernels(get_target("h100"))}
        hopper = {re.search(r"_bv\d+_w\d+_k\d", ks.name).group() for ks in built if ks.tier == "hopper"}
        assert len(hopper) == n_hopper, (path, sorted(hopper))
        assert any(ks.tier == "portable" and "_inter_" in ks.name for ks in built)
