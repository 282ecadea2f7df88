"""Kernel tiers (k3c/codegen/tiers.py): a Gluon source compiles ahead of time for sm_90a through the same
compile_kernels call as the portable kernels, the artifact records its tier, plans choose tiers from the Target,
and the runtime refuses (or, where JIT is asked for, replaces by the portable plan) a tier kernel this process's
Triton cannot build. The tier kernels' numerics run on the GPU (bench/, tests marked gpu)."""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from k3c.codegen import tiers
from k3c.codegen.aot import CompiledKernel, compile_kernels, report_markdown, shutdown_workers
from k3c.codegen.kernel import KernelSource
from k3c.codegen.kernels.mla import decode_plan
from k3c.codegen.targets import TARGETS, get_target, target_for_properties
from k3c.runtime import launcher

PROBE_SRC = '''from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma


@gluon.jit
def k3c_tier_probe_wgmma(a_ptr, b_ptr, c_ptr, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr):
    # C[M, N] = A[M, K] @ B[K, N]: one warpgroup MMA from shared memory
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, blocked))
    ks = gl.arange(0, K, layout=gl.SliceLayout(0, blocked))
    kr = gl.arange(0, K, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, blocked))
    a = gl.load(a_ptr + rows[:, None] * K + ks[None, :])
    b = gl.load(b_ptr + kr[:, None] * N + cols[None, :])
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [M, K], gl.NVMMASharedLayout.get_default_for([M, K], gl.bfloat16), a)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [K, N], gl.NVMMASharedLayout.get_default_for([K, N], gl.bfloat16), b)
    fence_async_shared()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    acc = warpgroup_mma(a_smem, b_smem, gl.zeros([M, N], gl.float32, acc_layout))
    gl.store(c_ptr + rows[:, None] * N + cols[None, :], gl.convert_layout(acc, blocked))
'''


def probe(builds_with: str = "3.9") -> KernelSource:
    return KernelSource("k3c_tier_probe_wgmma", PROBE_SRC, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32"},
                        {"M": 64, "N": 64, "K": 64}, ("1",), num_warps=4, num_stages=1, ir_op="linear",
                        tier="hopper", builds_with=builds_with)


@pytest.fixture(scope="module")
def compiled_probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")          # as in the CPU suite: the compile workers must clear it
        mp.setenv("K3C_CACHE_DIR", str(root / "cache"))
        (ck,) = compile_kernels([probe()], get_target("h200"), str(root / "out"), progress=False, keep_asm=True)
        yield ck, root / "out"
    shutdown_workers()


def test_gluon_source_compiles_ahead_of_time_for_sm90a(compiled_probe):
    ck, out = compiled_probe
    assert ck.tier == "hopper" and ck.arch == "sm_90"
    ptx = (out / ck.files["ptx"]).read_text()
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx
    assert (out / ck.binary).read_bytes()[:4] == b"\x7fELF"
    assert ck.metadata.get("triton_version", "").startswith(tiers.triton_release())
    assert sum(n for op, n in ck.resources.matrix_ops.items() if op.startswith("wgmma")) > 0 and not ck.resources.has_spills
    assert ck.resources.shared_bytes > 0


def test_manifest_and_report_record_the_tier(compiled_probe):
    ck, _ = compiled_probe
    entry = json.loads(json.dumps(ck.to_dict()))
    assert entry["tier"] == "hopper"
    assert CompiledKernel.from_dict(entry) == ck
    old = dict(entry)
    del old["tier"]                                  # an artifact written before tiers: portable
    assert CompiledKernel.from_dict(old).tier == "portable"
    report = report_markdown([ck], "h200")
    assert "`k3c_tier_probe_wgmma` (hopper tier)" in report and "1 hopper tier (Gluon)" in report


def test_targets_name_their_tiers():
    for name, t in TARGETS.items():
        assert set(t.tiers) <= set(tiers.TIERS), name
        assert t.has_tier("portable")
        for tier in t.tiers:
            assert tiers.tier_of(tier).arch == t.arch, (name, tier)
    derived = target_for_properties("cuda", "sm_89", name="NVIDIA L40S")
    assert derived.tiers == ()
    with pytest.raises(ValueError, match="unknown kernel tier"):
        tiers.tier_of("volta")


def test_mla_decode_plan_takes_the_tier_only_where_the_target_has_it():
    h200 = get_target("h200")
    assert h200.has_tier("hopper") and get_target("h100").has_tier("hopper")
    plan = decode_plan(96, 512, h200, cache_dtype="bf16", rope_dim=64)
    assert plan.tier == "hopper" and plan.block_h == 64 and plan.num_warps == 8
    assert decode_plan(17, 512, h200, cache_dtype="bf16", rope_dim=64).tier == "hopper"
    assert decode_plan(16, 512, h200, cache_dtype="bf16", rope_dim=64).tier == "portable"   # 12 heads: measured
    assert decode_plan(96, 512, h200, cache_dtype="bf16", rope_dim=64, tiers=False).tier == "portable"
    assert decode_plan(96, 512, h200, cache_dtype="bf16").tier == "portable"          # shape not known whole
    assert decode_plan(96, 512, h200, cache_dtype="fp32", rope_dim=64).tier == "portable"
    assert decode_plan(96, 512, h200, cache_dtype="fp8e4nv", rope_dim=64).tier == "portable"
    assert decode_plan(96, 512, h200, cache_dtype="bf16", rope_dim=32).tier == "portable"  # not a served shape
    assert decode_plan(96, 512, h200, cache_dtype="bf16", rope_dim=64, block_h=16).tier == "portable"  # explicit
    for name in ("mi355x", "mi300x", "b200", "b300", "cpu"):
        assert decode_plan(96, 512, get_target(name), cache_dtype="bf16", rope_dim=64).tier == "portable", name


def test_the_h200_catalogue_holds_the_hopper_decode_and_the_runtime_launches_it():
    """The catalogue and the run-time setup make the same choice (a meta-device decode records its launch)."""
    import k3c
    from k3c.codegen.catalogue import emit_kernels
    from k3c.runtime.kernel_impls import mla as rt

    model = k3c.compile("examples/k3-wide.yaml", target="h200")
    cat = {ks.key: ks for ks in emit_kernels(model.module, model.target)}
    hopper = [ks for ks in cat.values() if ks.tier == "hopper"]
    assert hopper and all(ks.builds_with == tiers.TIERS["hopper"].builds_with for ks in hopper)
    S, pps, ks, mk, _ = rt._decode_setup(4, 96, 576, 512, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, None,
                                         8, None, 192 ** -0.5, model.target, torch.device("meta"), False)
    assert ks.tier == "hopper" and ks.key in cat
def test_can_build_follows_the_triton_release():
    assert tiers.can_build(probe(tiers.triton_release()))
    assert not tiers.can_build(probe("3.6"))
    assert tiers.can_build(dataclasses.replace(probe("3.6"), tier="portable"))
    assert "Triton 3.6" in tiers.refusal(probe("3.6")) and "--allow-jit" in tiers.refusal(probe("3.6"))


@pytest.fixture
def cuda_slot():
    """A cuda device (no GPU is touched: bindings and the fallback rule are host state)."""
    launcher.reset_stats()
    yield torch.device("cuda", 7)
    launcher.reset_stats()


def test_unbuildable_tier_kernel_falls_back_where_jit_is_asked_for(cuda_slot, monkeypatch):
    ks = probe("0.0")
    with pytest.warns(RuntimeWarning, match="portable kernel instead"):
        assert launcher.tier_fallback(ks, cuda_slot)            # nothing bound: everything would be JIT-compiled
    assert launcher.stats().tier_fallbacks == [ks.name]
    for policy in ("allow-jit", "jit"):
        b = launcher.Binding(launcher.Catalogue(get_target("h200"), "/nonexistent", {ks.key: object()}),
                             get_target("h200"), policy)
        with warnings.catch_warnings():
            warnings.simplefilter("error")                      # said once per kernel
            assert launcher.tier_fallback(ks, cuda_slot, b)
    assert launcher.stats().tier_fallbacks == [ks.name]
    assert not launcher.tier_fallback(probe(tiers.triton_release()), cuda_slot)     # buildable here: JIT it
    assert not launcher.tier_fallback(ks, torch.device("cpu"))
    assert not launcher.tier_fallback(ks, torch.device("meta"))


def test_unbuildable_tier_kernel_is_refused_under_the_artifact_policy(cuda_slot, monkeypatch):
    ks = probe("0.0")
    other = launcher.Catalogue(get_target("h200"), "/nonexistent", {"another-kernel": object()})
    for policy in ("artifact", "strict"):
        b = launcher.Binding(other, get_target("h200"), policy)
        with pytest.raises(launcher.MissingKernelError, match="cannot build:") as err:
            launcher.tier_fallback(ks, cuda_slot, b)
        assert "\n" not in str(err.value)
    cat = launcher.Catalogue(get_target("h200"), "/nonexistent", {ks.key: object()})
    assert not launcher.tier_fallback(ks, cuda_slot, launcher.Binding(cat, get_target("h200"), "artifact"))
    # the same device, another model's binding: its own artifact decides (the first one's holds the kernel)
    with pytest.raises(launcher.MissingKernelError, match="cannot build:"):
        launcher.tier_fallback(ks, cuda_slot, launcher.Binding(other, get_target("h200"), "artifact"))
    monkeypatch.setenv("K3C_NO_JIT", "1")
    with pytest.raises(launcher.MissingKernelError, match="cannot build:"):
        launcher.tier_fallback(ks, cuda_slot)


def test_the_launcher_never_jit_compiles_an_unbuildable_tier_source(cuda_slot):
    ks = probe("0.0")
    p = launcher._prepared(ks)
    with pytest.raises(launcher.MissingKernelError, match="cannot build:"):
        launcher._resolve_runner(p, ks, ("cuda", 7), None)


def test_a_compile_plans_only_the_tiers_its_triton_can_build(monkeypatch):
    from dataclasses import asdict

    from k3c.api import _manifest_target
    from k3c.errors import UserError

    row = get_target("h200")
    assert row.tiers == ("hopper",)
    assert tiers.buildable_target(row) is row                   # this Triton writes the tier's sources
    monkeypatch.setattr(tiers, "triton_release", lambda: "3.6")
    monkeypatch.setattr(tiers, "_SAID", set())
    with pytest.warns(RuntimeWarning, match="portable kernels here"):
        built = tiers.buildable_target(row)
    assert built.tiers == () and built.name == "h200"
    # the artifact records what was built, and a load plans alike (a subset of the row's tiers, nothing else)
    assert _manifest_target("art", {"target": json.loads(json.dumps(asdict(built)))}) == built
    assert _manifest_target("art", {"target": json.loads(json.dumps(asdict(row)))}) == row
    forged = dict(json.loads(json.dumps(asdict(built))), tiers=["blackwell"])
    with pytest.raises(UserError, match="another row of the target table"):
        _manifest_target("art", {"target": forged})


def test_compiling_imports_no_triton():
    """A compile asks which tiers this Triton builds without importing it: `k3c run --interpret` sets
    TRITON_INTERPRET after the compile, and an earlier import of triton would fix it off for the process."""
    import subprocess
    import sys

    code = ("import sys, k3c; k3c.compile('examples/k3-tiny.yaml', target='h200'); "
            "from k3c.codegen import tiers; assert tiers.triton_release(); print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
