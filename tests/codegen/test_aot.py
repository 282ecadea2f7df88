"""AOT compilation for GPUs this machine does not have (k3c/codegen/aot.py, resources.py, cache.py).

The compile tests build two small kernels (bf16 add, bf16 64x64x64 tl.dot GEMM) once per target in a module fixture,
with TRITON_INTERPRET=1 set in this process (the workers must clear it) and K3C_CACHE_DIR pointed at a tmp dir.
The parser tests read real assembly saved under tests/codegen/data/ (see README.md there).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3c.codegen import aot
from k3c.codegen import resources as R
from k3c.codegen.aot import CompiledKernel, KernelCompileError, compile_kernels, report_markdown, shutdown_workers
from k3c.codegen.cache import CompileCache, cache_key
from k3c.codegen.kernel import KernelSource
from k3c.codegen.targets import get_target
from k3c.errors import ArgumentError, K3cError

DATA = Path(__file__).parent / "data"
TARGETS = ("mi355x", "mi300x", "h200", "b200")

ADD_SRC = '''import triton
import triton.language as tl


@triton.jit
def {name}(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # IR op: add
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)
'''

GEMM_SRC = '''import triton
import triton.language as tl


@triton.jit
def k3c_test_gemm(a_ptr, b_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # IR op: linear  (C[M, N] = A[M, K] @ B[K, N], bf16 in, fp32 accumulate)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)
'''

BROKEN_SRC = '''import triton
import triton.language as tl


@triton.jit
def k3c_test_broken(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    y = undefined_helper(x)
    tl.store(x_ptr + offs, y)
'''


MX_GEMM_SRC = '''import triton
import triton.language as tl


@triton.jit
def k3c_test_mx_gemm(a_ptr, b_ptr, as_ptr, bs_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # IR op: moe_expert (MXFP4 x MXFP4, e8m0 scales per 32 along K)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK // 2)
    rs = tl.arange(0, BK // 32)
    a = tl.load(a_ptr + rm[:, None] * (BK // 2) + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    sa = tl.load(as_ptr + rm[:, None] * (BK // 32) + rs[None, :])
    sb = tl.load(bs_ptr + rn[:, None] * (BK // 32) + rs[None, :])
    acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1")
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)
'''


def add_kernel(name="k3c_test_add", block=1024) -> KernelSource:
    return KernelSource(name, ADD_SRC.format(name=name),
                        {"x_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32"}, {"BLOCK": block},
                        (f"cdiv(n, {block})",), num_warps=4, num_stages=2, ir_op="add", loc="tiny.yaml:3")


def gemm_kernel() -> KernelSource:
    return KernelSource("k3c_test_gemm", GEMM_SRC, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32"},
                        {"N": 256, "K": 256, "BM": 64, "BN": 64, "BK": 64}, ("cdiv(M, 64)", "4"),
                        num_warps=4, num_stages=2, ir_op="linear", loc="tiny.yaml:7")


# ------------------------------------------------------------------------------------------------ compile fixture
@pytest.fixture(scope="module")
def aot_env(tmp_path_factory):
    """TRITON_INTERPRET=1 in this process (as in the CPU test suite), a private cache dir."""
    root = tmp_path_factory.mktemp("aot")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("K3C_CACHE_DIR", str(root / "cache"))
        yield root
    shutdown_workers()


@pytest.fixture(scope="module")
def compiled(aot_env):
    """target -> (list[CompiledKernel], out_dir) for add + GEMM."""
    out = {}
    for name in TARGETS:
        out_dir = aot_env / f"out_{name}"
        result = compile_kernels([add_kernel(), gemm_kernel()], get_target(name), str(out_dir), progress=False)
        out[name] = (result, out_dir)
        assert os.environ.get("TRITON_INTERPRET") == "1"          # the caller's environment is left as it was
    return out


def by_name(result):
    return {ck.name: ck for ck in result}


@pytest.mark.parametrize("target", TARGETS)
def test_files_and_binaries(compiled, target):
    result, out_dir = compiled[target]
    t = get_target(target)
    assert [ck.name for ck in result] == ["k3c_test_add", "k3c_test_gemm"]
    binary, asm = ("hsaco", "amdgcn") if t.backend == "hip" else ("cubin", "ptx")
    for ck in result:
        assert ck.target == target and ck.arch == t.arch and not ck.cache_hit
        assert set(ck.files) >= {"source", binary, asm, "ttgir", "metadata"}
        for rel in ck.files.values():
            assert (out_dir / rel).is_file(), rel
        assert (out_dir / "kernels" / f"{ck.name}.py").read_text().startswith("import triton")
        assert (out_dir / f"{ck.name}.{binary}").read_bytes()[:4] == b"\x7fELF"
        assert ck.binary == f"{ck.name}.{binary}"
        assert ck.entry == ck.name and ck.metadata["num_warps"] == 4
        assert ck.compile_seconds > 0
        r = ck.resources
        assert r.regs > 0 and r.scratch_bytes == 0 and r.spill_count == 0 and not r.has_spills
        assert 0 < r.occupancy <= r.occupancy_max
    add, gemm = result
    assert add.resources.matrix_ops == {} and add.shared == 0
    assert gemm.shared > 0 and gemm.resources.shared_bytes >= gemm.shared
    assert gemm.divisible_by_16 == ("a_ptr", "b_ptr", "c_ptr")
    asm_text = (out_dir / gemm.files[asm]).read_text()
    ops = gemm.resources.matrix_ops
    if t.backend == "hip":
        assert any(op.startswith("v_mfma") for op in ops), ops
        assert "v_mfma" in asm_text
        assert gemm.resources.vgpr and gemm.resources.sgpr
    elif t.arch == "sm_90":                                       # triton 3.9 picks wgmma (Hopper MMA v3)
        assert any(op.startswith("wgmma.mma_async") for op in ops), ops
    else:                                                         # sm_100: tcgen05 (5th-gen tensor cores)
        assert any(op.startswith("tcgen05.mma") for op in ops), ops


def test_gfx950_uses_its_own_mfma(compiled):
    gfx950 = by_name(compiled["mi355x"][0])["k3c_test_gemm"].resources.matrix_ops
    gfx942 = by_name(compiled["mi300x"][0])["k3c_test_gemm"].resources.matrix_ops
    assert any("32x32x16_bf16" in op or "16x16x32_bf16" in op for op in gfx950), gfx950   # CDNA4 bf16 MFMA
    assert any("32x32x8" in op or "16x16x16" in op for op in gfx942), gfx942


@pytest.mark.parametrize("target,expected", [("mi355x", "v_mfma_scale_f32_"), ("b200", "tcgen05.mma")])
def test_mxfp4_dot_scaled_uses_native_mx_instructions(aot_env, target, expected):
    """Targets with native_mxfp4 get scaled MFMA (gfx950) / tcgen05 block-scaled MMA (sm_100) for tl.dot_scaled."""
    assert get_target(target).native_mxfp4
    k = KernelSource("k3c_test_mx_gemm", MX_GEMM_SRC,
                     {"a_ptr": "*u8", "b_ptr": "*u8", "as_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*fp32"},
                     {"BM": 128, "BN": 128, "BK": 128}, num_warps=4, num_stages=1, ir_op="moe_expert")
    (ck,) = compile_kernels([k], target, str(aot_env / f"mx_{target}"), progress=False)
    ops = ck.resources.matrix_ops
    assert any(op.startswith(expected) for op in ops), ops
    if target == "b200":
        assert any("mxf4" in op and "block_scale" in op for op in ops), ops
    assert not ck.resources.has_spills


def test_cache_hit_compiles_nothing_and_is_identical(compiled, aot_env, monkeypatch):
    first, first_dir = compiled["mi355x"]
    out_dir = aot_env / "again_mi355x"

    def no_workers(*args, **kwargs):
        raise AssertionError("a cache hit must not start a compiler worker")

    monkeypatch.setattr(aot, "_executor", no_workers)
    again = compile_kernels([add_kernel(), gemm_kernel()], "mi355x", str(out_dir), progress=False)
    assert all(ck.cache_hit for ck in again)
    for a, b in zip(first, again):
        assert a.resources == b.resources and a.metadata == b.metadata and a.files == b.files
        for rel in a.files.values():
            assert (first_dir / rel).read_bytes() == (out_dir / rel).read_bytes()
    # a kernel-level change (ir_op/loc are not part of the digest) is still a hit but reports the new location
    moved = compile_kernels([dataclasses.replace(add_kernel(), loc="other.yaml:9")], "mi355x",
                            str(out_dir), progress=False)
    assert moved[0].cache_hit and moved[0].loc == "other.yaml:9"
    report = report_markdown(first + again, "mi355x")
    assert "**4 kernels** for mi355x" in report and "compile s" not in report and "| `k3c_test_gemm` | linear (tiny.yaml:7) |" in report
    assert "v_mfma" in report and "waves/SIMD" in report


def test_broken_kernel_names_kernel_op_and_loc(aot_env):
    broken = KernelSource("k3c_test_broken", BROKEN_SRC, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 128},
                          ir_op="kda_chunk", loc="k3-tiny.yaml:21")
    good = add_kernel("k3c_test_add_b", block=512)
    with pytest.raises(KernelCompileError) as info:
        compile_kernels([good, broken], "mi300x", str(aot_env / "broken"), progress=False)
    err = info.value
    assert isinstance(err, K3cError)
    text = str(err)
    assert "k3c_test_broken" in text and "kda_chunk" in text and "k3-tiny.yaml:21" in text and "mi300x" in text
    assert "undefined_helper" in text
    assert len(text.splitlines()) < 25
    assert err.kernel == "k3c_test_broken" and err.failed == ("k3c_test_broken",)
    # the good kernel beside it was compiled and cached anyway
    again = compile_kernels([good], "mi300x", str(aot_env / "broken2"), progress=False)
    assert again[0].cache_hit


def test_manifest_round_trip(compiled, aot_env):
    result, out_dir = compiled["h200"]
    assert [CompiledKernel.from_dict(json.loads(json.dumps(ck.to_dict()))) for ck in result] == result
    for ck in result:       # every file of a kernel is hashed; the catalogue key is the source's
        assert set(ck.sha256) == set(ck.files.values()) and ck.catalogue_key


def test_manifest_entries_do_not_depend_on_how_the_kernel_was_got():
    """A fresh compile and a cache hit list files, metadata and matrix instructions in different orders and differ in
    time and cache_hit: the manifest entry (what the artifact holds) must be the same bytes."""
    res = R.KernelResources(backend="cuda", arch="sm_90", regs=32, matrix_ops={"wgmma.m64n64k16": 2, "wgmma.m64n16k16": 4})
    flipped = dataclasses.replace(res, matrix_ops={"wgmma.m64n16k16": 4, "wgmma.m64n64k16": 2})
    common = dict(name="k", target="h200", backend="cuda", arch="sm_90", signature={"x": "*bf16"}, constexprs={},
                  grid=("1",), num_warps=4, num_stages=2)
    fresh = CompiledKernel(files={"source": "kernels/k.py", "cubin": "k.cubin"}, resources=res,
                           metadata={"shared": 0, "name": "k"}, compile_seconds=3.0, **common)
    hit = CompiledKernel(files={"cubin": "k.cubin", "source": "kernels/k.py"}, resources=flipped,
                         metadata={"name": "k", "shared": 0}, cache_hit=True, **common)
    assert json.dumps(fresh.to_dict()) == json.dumps(hit.to_dict()) and fresh == hit
    assert "compile_seconds" not in fresh.to_dict() and "cache_hit" not in fresh.to_dict()


def test_bad_arguments(aot_env):
    with pytest.raises(ArgumentError):
        compile_kernels([add_kernel()], "cpu", str(aot_env / "cpu"))
    other = KernelSource("k3c_test_add", ADD_SRC.format(name="k3c_test_add") + "\n# different\n",
                         add_kernel().signature, {"BLOCK": 1024})
    with pytest.raises(ArgumentError, match="two different kernels"):
        compile_kernels([add_kernel(), other], "h200", str(aot_env / "dup"))


def test_importing_aot_does_not_import_triton():
    """The calling process may run the interpreter (TRITON_INTERPRET=1); the AOT modules never import triton."""
    code = ("import sys, k3c, k3c.codegen; before = 'triton' in sys.modules\n"
            "import k3c.codegen.aot, k3c.codegen.cache, k3c.codegen.resources\n"
            "print(before or 'triton' not in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


# ------------------------------------------------------------------------------------------------------- cache
def test_cache_publish_lookup_and_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("K3C_CACHE_DIR", str(tmp_path / "c"))
    store = CompileCache()
    assert store.root.startswith(str(tmp_path))
    key = cache_key("0123456789abcdef", get_target("mi355x"), {"x": 1})
    assert key != cache_key("0123456789abcdef", get_target("mi300x"), {"x": 1})
    assert key != cache_key("0123456789abcdef", get_target("mi355x"), {"x": 2})
    assert store.lookup(key) is None

    def staged(payload: bytes) -> str:
        d = store.new_staging_dir()
        os.makedirs(os.path.join(d, "kernels"))
        Path(d, "kernels", "k.py").write_text("src")
        Path(d, "k.hsaco").write_bytes(payload)
        return d

    files = {"source": "kernels/k.py", "hsaco": "k.hsaco"}
    first = staged(b"\x7fELF1")
    store.publish(key, first, {"files": files})
    assert not os.path.exists(first)
    second = staged(b"\x7fELF2")                       # a concurrent writer of the same key loses quietly
    store.publish(key, second, {"files": files})
    assert not os.path.exists(second)
    out = tmp_path / "out"
    entry = store.fetch(key, str(out))
    assert entry["files"] == files and (out / "k.hsaco").read_bytes() == b"\x7fELF1"
    Path(store.entry_dir(key), "k.hsaco").write_bytes(b"\x7fELF1")    # rewritten with its own bytes: still a hit
    assert store.lookup(key) is not None
    Path(store.entry_dir(key), "k.hsaco").write_bytes(b"\x7fELF9")    # tampered (same size): a miss, and removed
    assert store.lookup(key) is None and not os.path.exists(store.entry_dir(key))
    store.publish(key, staged(b"\x7fELF1"), {"files": files})
    os.unlink(os.path.join(store.entry_dir(key), "k.hsaco"))    # damaged entry: a miss, and removed
    assert store.lookup(key) is None and not os.path.exists(store.entry_dir(key))
    leftover = store.new_staging_dir()                 # what a killed run leaves: never visible as an entry
    Path(leftover, "k.hsaco").write_bytes(b"partial")
    assert store.lookup(key) is None


# ------------------------------------------------------------------------------------------- parsers on real asm
def test_parse_amdgcn_gfx950_gemm():
    text = (DATA / "gfx950_gemm.amdgcn").read_text()
    info = R.parse_amdgcn(text, "k3c_gemm")
    assert info["vgpr"] == 62 and info["total_vgpr"] == 62 and info["sgpr"] == 26 and info["agpr"] == 0
    assert info["scratch"] == 0 and info["occupancy"] == 8 and info["code_bytes"] == 4128
    r = R.amd_resources("gfx950", text, shared=50992, num_warps=4, kernel="k3c_gemm")
    assert r.matrix_ops == {"v_mfma_f32_32x32x16_bf16": 32}
    assert (r.occupancy, r.occupancy_limiter) == (3, "lds")          # 160 KiB / 50992 B = 3 workgroups
    assert R.amd_resources("gfx950", text, shared=0).occupancy == 8  # LLVM agrees without dynamic LDS
    assert R.amd_resources("gfx942", text, shared=50992).occupancy == 1   # 64 KiB LDS on gfx942


def test_parse_amdgcn_gfx942_spills():
    text = (DATA / "gfx942_gemm_spill.amdgcn").read_text()
    r = R.amd_resources("gfx942", text, shared=16384, num_warps=1, kernel="k3c_gemm_spill")
    assert (r.vgpr, r.agpr, r.regs, r.sgpr) == (256, 256, 512, 55)
    assert r.scratch_bytes == 4448 and r.spill_count == 2904 and r.has_spills
    assert r.occupancy == 1 == r.compiler_occupancy and r.occupancy_limiter == "vgpr"
    assert r.matrix_ops == {"v_mfma_f32_32x32x8_bf16": 256}


def test_parse_cubin_and_ptx():
    cubin = (DATA / "sm90_gemm.cubin").read_bytes()
    info = R.parse_cubin(cubin, "k3c_gemm")                          # cuobjdump -res-usage: REG:70 SHARED:1024
    assert info["regs"] == 70 and info["frame_bytes"] == 0 and info["static_shared"] == 1024
    r = R.nv_resources("sm_90", cubin, (DATA / "sm90_gemm.ptx").read_text(), kernel="k3c_gemm", shared=49152)
    assert r.matrix_ops == {"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16": 4}
    assert r.shared_bytes == 50176 and (r.occupancy, r.occupancy_limiter) == (16, "smem")
    assert R.parse_cubin((DATA / "sm100_add.cubin").read_bytes(), "k3c_add")["regs"] == 26
    assert R.ptx_matrix_ops((DATA / "sm100_gemm.ptx").read_text()) == {"tcgen05.mma.cta_group::1.kind::f16": 8}
    log = R.parse_ptxas_log((DATA / "sm90_gemm_spill.ptxas.log").read_text())
    assert log == {"regs": 64, "frame_bytes": 5456, "spill_stores": 11952, "spill_loads": 11948}


def test_occupancy_models():
    assert R.amd_occupancy("gfx950", vgpr=117, sgpr=104)[0] == 4       # LLVM's `; Occupancy: 4` for this kernel
    assert R.amd_occupancy("gfx942", vgpr=12, sgpr=21) == (8, 8, "waves")
    assert R.amd_occupancy("gfx950", vgpr=128, agpr=128)[0] == 2       # unified 512-entry file: 256 -> 2 waves
    assert R.amd_occupancy("gfx942", vgpr=64, num_warps=8)[0] == 8     # 2 waves per SIMD per workgroup
    assert R.nv_occupancy("sm_90", regs=255, num_warps=4) == (8, 64, "regs")
    assert R.nv_occupancy("sm_100", regs=32, num_warps=4) == (64, 64, "waves")
    assert R.nv_occupancy("sm_90", regs=32, shared_bytes=100 * 1024, num_warps=8)[0] == 16


def test_report_flags_spills():
    res = R.amd_resources("gfx942", (DATA / "gfx942_gemm_spill.amdgcn").read_text(), shared=16384, num_warps=1)
    ck = CompiledKernel(name="k3c_big", target="mi300x", backend="hip", arch="gfx942",
                        files={"hsaco": "k3c_big.hsaco"}, signature={}, constexprs={}, grid=("1",), num_warps=1,
                        num_stages=1, resources=res, compile_seconds=1.5, ir_op="moe_expert", loc="k3.yaml:40")
    text = report_markdown([ck], "mi300x")
    assert "SPILL" in text and "1 with scratch/spills" in text and "`k3c_big` (moe_expert)" in text
    assert "256 V / 55 S / 256 A" in text and "1.5" not in text          # build times stay out of the artifact
