"""Pieces shared by the MLA kernel emitters (mla.py, mla_latent.py): tile extents, the paged-pool offset formula
and the dot operand / precision parts."""
from __future__ import annotations

from .common import pow2_ceil

LOG2E = 1.4426950408889634


def _blk(n: int) -> int:
    """A tile extent for a head dim: a power of two, at least 16 (tl.dot needs K >= 16 on GPUs; padding is masked)."""
    return max(16, pow2_ceil(n))


def paged_offset(page_id: int, slot: int, col: int, page_size: int, width: int) -> int:
    """Element offset of (page, slot, column) in a pool [num_pages, page_size, width]: the kernels' int64 formula."""
    return page_id * (page_size * width) + slot * width + col


def _dot_parts(dtype: str, interp: bool) -> tuple[str, str]:
    """(operand upcast suffix, tl.dot keyword) for operands of `dtype` (interpreter: bf16 -> fp32 copies; fp32 on
    GPUs: exact IEEE products, not tf32)."""
    if dtype == "fp32":
        return "", ', input_precision="ieee"'
    if interp:
        return ".to(tl.float32)", ', input_precision="ieee"'
    return "", ""
