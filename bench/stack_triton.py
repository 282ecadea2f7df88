"""Two small Triton kernels for bench/stack.py, standing in for vLLM's fused custom ops that are not in a wheel the
peers' carry can take apart: SiTU-GLU (vLLM's SituAndMul) and RMSNorm. One kernel per call each, fp32 inside, so the
stack does not pay a chain of torch elementwise kernels where vLLM pays one."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _situ_glu_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, n_cols, beta_g, beta_u,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tg = 2.0 * tl.sigmoid(2.0 * g / beta_g) - 1.0                       # tanh(x) = 2 sigmoid(2x) - 1
    tu = 2.0 * tl.sigmoid(2.0 * u / beta_u) - 1.0
    y = (beta_g * tg * tl.sigmoid(g)) * (beta_u * tu)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta_g: float, beta_u: float) -> torch.Tensor:
    """[beta_g tanh(g/beta_g) sigmoid(g)] * [beta_u tanh(u/beta_u)] for row-strided g, u [M, n] (unit column
    stride), in g's dtype."""
    M, n = g.shape
    y = torch.empty(M, n, dtype=g.dtype, device=g.device)
    if M == 0:
        return y
    BLOCK = 1024
    _situ_glu_kernel[(M, triton.cdiv(n, BLOCK))](g, u, y, g.stride(0), u.stride(0), y.stride(0), n, float(beta_g),
                                                 float(beta_u), BLOCK=BLOCK, num_warps=4)
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (x * r * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim of a row-strided x [M, n]; x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]) if x.dim() != 2 else x
    M, n = x2.shape
    y = torch.empty(M, n, dtype=x.dtype, device=x.device)
    if M:
        BLOCK = triton.next_power_of_2(n)
        _rms_norm_kernel[(M,)](x2, weight, y, x2.stride(0), y.stride(0), n, float(eps), BLOCK=BLOCK,
                               num_warps=8 if BLOCK >= 4096 else 4)
    return y.view(shape)
