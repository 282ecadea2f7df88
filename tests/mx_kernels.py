"""A small MXFP4 x MXFP4 Triton kernel (tl.dot_scaled): the cross-compile tests' probe of native MX support."""

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
