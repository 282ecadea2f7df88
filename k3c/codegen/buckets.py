"""The token-count buckets GEMM kernels are specialised for: the runtime picks a bucket per call, the catalogue emits
one kernel per bucket, so both name the same kernels."""
from __future__ import annotations

from .kernels.common import pow2_ceil

M_BUCKET_MAX = 1024
M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)    # every m_hint the GEMM wrappers can ask for (AOT: emit these)


def m_bucket(m: int) -> int:
    """The token-count bucket the GEMM tiles are specialised for: powers of two from 16 to 1024 (every M >= 513
    shares the 1024 kernel; tiles only change below that, and the program-count rule needs M's scale)."""
    return max(16, min(M_BUCKET_MAX, pow2_ceil(max(1, m))))
