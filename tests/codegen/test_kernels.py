"""Generated Triton kernels (k3c.codegen.kernels via k3c.runtime.kernel_impls) against the eager reference.

On a CPU the kernels run in Triton's interpreter (launch sets TRITON_INTERPRET=1 while it defines and runs them), so
shapes stay small. Metric: ||out - ref|| / ||ref||, <= 1e-5 for fp32 and <= 1e-2 for bf16 (DESIGN.md).
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3c import __version__
from k3c.codegen.buckets import M_BUCKETS, m_bucket
from k3c.runtime import launcher as RL
from k3c.runtime.kernel_impls import basic as L
from k3c.codegen.kernels import emit_embedding, emit_gemm, emit_gemm_glu, emit_rmsnorm, gemm_plan, row_plan
from k3c.codegen.targets import TARGETS, get_target
from k3c.codegen.writer import CodegenError, SourceWriter, comment_text, ident, num
from k3c.frontend.spec import ActivationSpec
from k3c.reference import glu_act, linear, rms_norm

REPO = Path(__file__).resolve().parents[2]
CPU = get_target("cpu")
SWIGLU = ActivationSpec("swiglu")
SITU = ActivationSpec("situ", situ_beta_gate=4.0, situ_beta_up=25.0)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert torch.isfinite(out).all()
    err = rel(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.0e}"


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)
    with torch.no_grad():
        yield


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


# -- rmsnorm ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,M", [(64, 1), (96, 7), (200, 33)])       # 96, 200: not powers of two (masked)
def test_rmsnorm(dtype, D, M):
    x, w = randn(M, D, dtype=dtype, scale=3.0), randn(D, dtype=dtype)
    out, res = L.rmsnorm(x, w, 1e-6)
    assert res is None
    close(out, rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_block,M", [(None, 1), (None, 33), (64, 1), (64, 7)])   # 64 < 200: two-pass loop
def test_rmsnorm_residual(dtype, max_block, M):
    D = 200
    x, r, w = randn(2, M, D, dtype=dtype), randn(2, M, D, dtype=dtype, scale=2.0), randn(D, dtype=dtype)
    out, new_r = L.rmsnorm(x, w, 1e-5, residual=r, max_block=max_block)
    close(new_r, x + r, dtype)
    close(out, rms_norm(x + r, w, 1e-5), dtype)
    if dtype == torch.float32:   # the sum is rounded once to the residual dtype, then normed: same as eager
        assert torch.equal(new_r, x + r)


def test_rmsnorm_variants():
    x, r = randn(5, 96, dtype=torch.bfloat16), randn(5, 96)              # bf16 x + fp32 residual stream
    w = randn(96)
    out, new_r = L.rmsnorm(x, w, 1e-6, residual=r)
    assert new_r.dtype == torch.float32 and out.dtype == torch.float32
    close(out, rms_norm(x + r, w, 1e-6), torch.float32)
    r2 = r.clone()
    out2, same = L.rmsnorm(x, w, 1e-6, residual=r2, inplace=True)
    assert same is r2 and torch.equal(r2, new_r) and torch.equal(out2, out)
    xo = randn(3, 64)
    close(L.rmsnorm(xo, None, 1e-6)[0], rms_norm(xo, None, 1e-6), torch.float32)       # no weight
    xl = randn(2, 7168, dtype=torch.bfloat16)                                              # K3 hidden size
    wl = randn(7168, dtype=torch.bfloat16)
    close(L.rmsnorm(xl, wl, 1e-6)[0], rms_norm(xl, wl, 1e-6), torch.bfloat16)
    close(L.rmsnorm(xl, wl, 1e-6, max_block=2048)[0], rms_norm(xl, wl, 1e-6), torch.bfloat16)


# -- embedding ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 200])
def test_embedding(dtype, D):
    table = randn(50, D, dtype=dtype)
    ids = torch.randint(0, 50, (3, 5))
    out = L.embedding(ids, table)
    assert out.shape == (3, 5, D) and torch.equal(out, table[ids])
    assert torch.equal(L.embedding(ids[0].int(), table), table[ids[0]])
    bad = torch.tensor([1, -1, 50, 7])                      # out-of-range ids read nothing, give zero rows
    out = L.embedding(bad, table)
    assert torch.equal(out[[0, 3]], table[[1, 7]]) and not out[[1, 2]].any()


# -- gemm ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (7, 200, 160), (33, 96, 40), (33, 200, 160), (1, 200, 160)])
def test_gemm(dtype, M, N, K):
    a, w = randn(M, K, dtype=dtype), randn(N, K, dtype=dtype, scale=K ** -0.5)
    close(L.gemm(a, w), linear(a, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [None, "silu", "sigmoid", ("situ_gate", 4.0), ("situ_up", 25.0)])
def test_gemm_epilogue(dtype, act):
    N, K = 200, 160
    a, w = randn(3, 11, K, dtype=dtype), randn(N, K, dtype=dtype, scale=2 * K ** -0.5)     # M = 33 rows
    b, res = randn(N, dtype=dtype), randn(3, 11, N, dtype=dtype)
    y = linear(a.float(), w.float()) + b.float()
    if act == "silu":
        y = F.silu(y)
    elif act == "sigmoid":
        y = torch.sigmoid(y)
    elif isinstance(act, tuple) and act[0] == "situ_gate":
        y = act[1] * torch.tanh(y / act[1]) * torch.sigmoid(y)
    elif isinstance(act, tuple):
        y = act[1] * torch.tanh(y / act[1])
    ref = (y + res.float()).to(dtype)
    close(L.gemm(a, w, bias=b, act=act, residual=res), ref, dtype)


def test_gemm_mixed_and_out_dtype():
    a, w = randn(7, 96, dtype=torch.bfloat16), randn(64, 96)              # fp32 weight cast per tile like linear()
    close(L.gemm(a, w), linear(a, w), torch.bfloat16)
    out = L.gemm(a, w.bfloat16(), out_dtype=torch.float32, act="sigmoid")   # router-style fp32 scores
    close(out, torch.sigmoid(a.float() @ w.bfloat16().float().T), torch.float32)


@pytest.mark.parametrize("tname", ["mi355x", "h200", "mi300x"])
def test_gemm_gpu_tiles_in_interpreter(tname):
    """The tiles planned for GPU targets (128-wide, K-masked, N-wrapped) are correct too (fp32, interpreter)."""
    a, w, wu = randn(33, 160), randn(200, 160), randn(200, 160)
    close(L.gemm(a, w, target=tname), linear(a, w), torch.float32)
    close(L.gemm_glu(a, w, wu, SITU, target=tname), glu_act(linear(a, w), linear(a, wu), SITU), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [SWIGLU, SITU], ids=["swiglu", "situ"])
@pytest.mark.parametrize("M,Fd", [(1, 96), (33, 200)])
def test_gemm_glu(dtype, act, M, Fd):
    K = 160
    a = randn(M, K, dtype=dtype)
    wg, wu = randn(Fd, K, dtype=dtype, scale=3 * K ** -0.5), randn(Fd, K, dtype=dtype, scale=30 * K ** -0.5)
    ref = glu_act(linear(a, wg), linear(a, wu), act)
    close(L.gemm_glu(a, wg, wu, act), ref, dtype)
    merged = torch.cat([wg, wu], 0)                                          # gate_up_proj as its two halves
    close(L.gemm_glu(a, merged[:Fd], merged[Fd:], act), ref, dtype)


def test_gemm_glu_tanh_small_and_large():
    """The SiTU epilogue's tanh on both sides of its Taylor / exp switch and past its clamp: A = [g | u] against
    selector weights, so the fp32 products are exactly g and u."""
    g = torch.tensor([[0.0, 1e-6, -1e-4, 0.1, -0.12, 0.13, 0.5, -3.0, 60.0, -80.0, 1e4, -1e4]])
    u = g.flip(-1) * 10
    f = g.shape[-1]
    eye, zero = torch.eye(f), torch.zeros(f, f)
    for act in (SITU, ActivationSpec("situ", situ_beta_gate=0.5, situ_beta_up=2.0)):
        out = L.gemm_glu(torch.cat([g, u], -1), torch.cat([eye, zero], -1), torch.cat([zero, eye], -1), act)
        torch.testing.assert_close(out, glu_act(g, u, act), rtol=2e-6, atol=1e-7)


def test_empty_batch():
    x = torch.empty(0, 64)
    assert L.rmsnorm(x, torch.ones(64), 1e-6)[0].shape == (0, 64)
    assert L.gemm(x, randn(32, 64)).shape == (0, 32)


# -- generated source, writer, memoisation -------------------------------------------------------------------------
def test_header_and_names():
    loc = "examples/k3-tiny.yaml:13\nimport os  # \u00e9\x00"
    ks = emit_rmsnorm(200, 1e-6, target=get_target("mi355x"), residual=True, ir_op="rms_norm[post]", loc=loc)
    lines = ks.source.splitlines()
    assert lines[0].startswith("# k3c generated Triton kernel: k3c_rmsnorm_residual_fwd_d200_bf16")
    assert "# IR op: rms_norm[post] loc: examples/k3-tiny.yaml:13 import os #" in lines[1]
    assert lines[2].startswith("# target: mi355x (hip gfx950, warp 64")
    assert f"k3c {__version__}" in lines[3]
    assert "import os" not in [ln.strip() for ln in lines]
    assert ks.source.isascii() and "\x00" not in ks.source
    assert ks.loc == loc and ks.ir_op == "rms_norm[post]"
    for emit in (lambda: emit_embedding(10, 64, target=CPU), lambda: emit_gemm(64, 64, target=CPU),
                 lambda: emit_gemm_glu(64, 64, target=CPU)):
        ks = emit()
        assert ks.source.startswith("# k3c generated Triton kernel: " + ks.name)
        assert "# IR op: " in ks.source and "# target: cpu" in ks.source
        compile(ks.source, ks.name, "exec")                                   # valid Python
        assert f"def {ks.name}(" in ks.source


@pytest.mark.parametrize("bad", ["x; import os", "1abc", "", "a b", "class", "None", "x\nimport os", "é", "a.b",
                                 "__import__('os')", "x" * 200])
def test_writer_rejects_bad_names(bad):
    with pytest.raises(CodegenError):
        ident(bad)
    with pytest.raises(CodegenError):
        emit_rmsnorm(64, 1e-6, target=CPU, name=bad)
    w = SourceWriter()
    with pytest.raises(CodegenError):
        with w.jit_function("k", ["x", bad]):
            pass


def test_writer_numbers_and_lines():
    assert num(1e-6) == "1e-06" and num(7168) == "7168" and num(True) == "True" and num(0.1) == "0.1"
    for bad in (float("nan"), float("inf"), "3", None, [1]):
        with pytest.raises(CodegenError):
            num(bad)
    with pytest.raises(CodegenError):
        emit_rmsnorm(64, float("nan"), target=CPU)
    with pytest.raises(CodegenError):
        emit_gemm_glu(64, 64, ActivationSpec("situ", situ_beta_gate=float("inf")), target=CPU)
    assert comment_text("a\n\tb\u2028c\x7f") == "a b c"
    w = SourceWriter()
    with pytest.raises(CodegenError):
        w.line("x = 1\nimport os")
    with w.indent():
        w.line("y = 2")
    assert w.getvalue() == "    y = 2\n"


def test_grid_evaluator():
    env = {"M": 33, "N": 200, "BLOCK_M": 16, "BLOCK_N": 64}
    assert RL.eval_grid(("cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)",), env) == (12,)
    assert RL.eval_grid(("M", "max(1, N // 64 - 1)", "min(3, 2) + 0"), env) == (33, 2, 2)
    for bad in ["__import__('os')", "M.bit_length()", "M ** 2", "(lambda: 1)()", "K", "open('x')",
                "cdiv(M, b=2)", "1.5", "M if N else 1", "[M][0]", "M; N", "cdiv(*[M, 2])", "True",
                "getattr(M, 'real')", "M - 100", "M * " + "9" * 20, "x" * 300]:
        with pytest.raises(RL.GridError):
            RL.eval_grid((bad,), env)
    with pytest.raises(RL.GridError):
        RL.eval_grid(("cdiv(M, 0)",), env)
    with pytest.raises(RL.GridError):
        RL.eval_grid(("1", "70000"), env)


def test_launch_checks_and_memo():
    env_before = os.environ.get("TRITON_INTERPRET")
    ks = emit_rmsnorm(64, 1e-6, target=CPU, dtype="fp32")
    x, w, out = randn(3, 64), randn(64), torch.empty(3, 64)
    with pytest.raises(CodegenError):
        RL.launch(ks, x, w, out)                                               # missing M
    with pytest.raises(CodegenError):
        RL.launch(ks, x.bfloat16(), w, out, 3)                                 # wrong dtype
    with pytest.raises(CodegenError):
        RL.launch(ks, x, w, out, 3.0)                                          # float for i32
    RL.launch(ks, x, w, out, 3)
    close(out, rms_norm(x, w, 1e-6), torch.float32)
    fn = RL.load_kernel(ks, True)
    assert RL.load_kernel(ks, True) is fn
    mod = sys.modules[fn.fn.__module__]
    assert Path(mod.__file__).parent == RL.kernel_dir() and mod.__name__.startswith("k3c_gen_")
    misses = L._emit_rmsnorm.cache_info().misses
    L.rmsnorm(x, w, 1e-6)
    n_fast = len(L._FAST)
    L.rmsnorm(x[:2], w, 1e-6)                                                # same spec: memoised, not re-emitted
    assert len(L._FAST) == n_fast and L._emit_rmsnorm.cache_info().misses <= misses + 1
    L.rmsnorm(x, w, 1e-6, target="mi355x")                                   # another target: another kernel
    assert L._emit_rmsnorm.cache_info().misses == misses + 2 or len(L._FAST) == n_fast + 1
    assert os.environ.get("TRITON_INTERPRET") == env_before                 # restored after loading/launching


# -- block-size plans from the target --------------------------------------------------------------------------------
def test_plans_follow_targets():
    assert sorted({m_bucket(m) for m in range(1, 3000)}) == list(M_BUCKETS)
    for t in TARGETS.values():
        for m, n, n_b in itertools.product((1, *M_BUCKETS, 4096), (200, 3584, 7168), (1, 2)):
            p = gemm_plan(m, n, 7168, 2, t, n_b=n_b)
            assert p.smem_bytes <= t.shared_mem_bytes
            assert min(p.block_m, p.block_n, p.block_k) >= 16                  # tl.dot's minimum on every backend
            if t.shared_mem_bytes:
                assert p.num_stages >= 2
                assert p.num_stages * (p.block_m + n_b * p.block_n) * p.block_k * 2 == p.smem_bytes
    tiles = {(n, n_b): gemm_plan(4096, 7168, 7168, 2, TARGETS[n], n_b=n_b)
             for n in ("mi355x", "h200", "mi300x") for n_b in (1, 2)}
    for n in ("mi355x", "h200"):
        assert (tiles[n, 1].block_m, tiles[n, 1].block_n, tiles[n, 1].block_k) == (128, 256, 64)
        assert (tiles[n, 2].block_m, tiles[n, 2].block_n, tiles[n, 2].block_k) == (128, 128, 64)   # 2 accumulators
    assert tiles["mi300x", 1].block_n < 256 and tiles["mi300x", 2].block_n < 128                 # 64 KiB LDS
    assert gemm_plan(1, 7168, 7168, 2, TARGETS["h200"]).block_m == 16                      # decode
    for n in ("mi355x", "h200", "b200"):
        assert not row_plan(7168, 2, TARGETS[n]).looped                                    # K3 hidden: one pass
    assert row_plan(7168, 2, TARGETS["mi355x"]).num_warps * 64 >= 256
    assert row_plan(200, 4, CPU, max_block=64).looped


# -- portability: every family compiles ahead of time for gfx950 and sm_90 -----------------------------------------
AOT_SCRIPT = textwrap.dedent("""
    import importlib.util, os, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from k3c.codegen.targets import TARGETS
    from k3c.codegen.kernels import *
    d = tempfile.mkdtemp()
    for tn in ("mi355x", "h200"):
        t = TARGETS[tn]
        for ks in (emit_rmsnorm(200, 1e-6, target=t, residual=True, max_block=64),
                   emit_embedding(100, 96, target=t),
                   emit_gemm(200, 160, target=t, m_hint=16, bias=True, act=("situ_gate", 4.0), residual=True),
                   emit_gemm_glu(96, 64, "situ", target=t, m_hint=64)):
            path = os.path.join(d, "m_" + ks.digest + ".py")
            open(path, "w").write(ks.source)
            spec = importlib.util.spec_from_file_location("m_" + ks.digest, path)
            mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
            sig = dict(ks.signature); sig.update({k: "constexpr" for k in ks.constexprs})
            attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(ks.signature.values()) if ty[0] == "*"}
            src = triton.compiler.ASTSource(getattr(mod, ks.name), signature=sig, constexprs=dict(ks.constexprs),
                                            attrs=attrs)
            c = triton.compile(src, target=GPUTarget(*t.triton_target),
                               options={"num_warps": ks.num_warps, "num_stages": ks.num_stages})
            assert ("hsaco" if t.backend == "hip" else "cubin") in c.asm, (tn, ks.name)
            assert c.metadata.shared <= t.shared_mem_bytes, (tn, ks.name, c.metadata.shared)
            print(tn, ks.name, "ok")
""")


@pytest.mark.slow
def test_families_compile_for_gfx950_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count(" ok") == 8


# -- on a GPU (skipped without CUDA): the plain-JIT path, the real tile sizes, model-sized shapes ----------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


def cuda(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M", [1, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_row_kernels(M, dtype):
    D = 7168
    x, r, w = cuda(M, D, dtype=dtype), cuda(M, D, dtype=dtype, scale=2.0), cuda(D, dtype=dtype)
    close(L.rmsnorm(x, w, 1e-6)[0], rms_norm(x, w, 1e-6), dtype)
    out, new_r = L.rmsnorm(x, w, 1e-6, residual=r)
    close(new_r, x + r, dtype)
    close(out, rms_norm(x + r, w, 1e-6), dtype)
    rf = r.float()
    out, new_r = L.rmsnorm(x, w, 1e-6, residual=rf)                                     # fp32 residual stream
    close(out, rms_norm(x + rf, w, 1e-6), torch.float32)
    table = cuda(1000, D, dtype=dtype)
    ids = torch.randint(0, 1000, (M,), device="cuda")
    assert torch.equal(L.embedding(ids, table), table[ids])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M", [1, 77, 1024])
def test_gpu_gemm(M):
    N, K, Fd = 7168, 7168, 3584
    a, w = cuda(M, K), cuda(N, K, scale=K ** -0.5)
    b, res = cuda(N), cuda(M, N)
    close(L.gemm(a, w), linear(a, w), torch.bfloat16)
    ref = (F.silu(linear(a.float(), w.float()) + b.float()) + res.float()).bfloat16()
    close(L.gemm(a, w, bias=b, act="silu", residual=res), ref, torch.bfloat16)
    wg, wu = cuda(Fd, K, scale=3 * K ** -0.5), cuda(Fd, K, scale=30 * K ** -0.5)
    for act in (SWIGLU, SITU):
        close(L.gemm_glu(a, wg, wu, act), glu_act(linear(a, wg), linear(a, wu), act), torch.bfloat16)
    a32, w32 = a[:, :160].float(), w[:200, :160].float()                           # fp32, ieee dot
    close(L.gemm(a32, w32), a32.double().matmul(w32.double().T).float(), torch.float32)
