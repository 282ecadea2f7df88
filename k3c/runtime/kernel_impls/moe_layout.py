"""The load-time lanes layout of MXFP4 expert payloads (k3c.codegen.kernels.moe_lanes describes it and why): per
64-byte group of a row, byte c * 16 + i <- canonical byte 4 i + c, then the 32 bits of every stored word in the
perm order of the pair decode. Scales are not touched. Made once at load, in place (the stack is rewritten one
slab at a time, so no second copy of it exists), and undone the same way (checkpoint writes, the torch reference)."""
from __future__ import annotations

import torch

from ...codegen.kernels.moe_lanes import LANES_GROUP_K
from ..expert_layout import _permute_bits

_GROUP_BYTES = LANES_GROUP_K // 2
_SLAB_BYTES = 1 << 26       # rows rewritten per step: bounded temporaries for K3's 36 GiB stacks


def perm_words(packed: torch.Tensor) -> torch.Tensor:
    """Only the bit step: each aligned 4-byte word of canonical payload bytes [..., K/2] in the perm order (bytes
    stay where they are; bench/moe_forms.py's perm form reads this)."""
    if packed.dtype != torch.uint8 or packed.dim() < 1 or packed.shape[-1] % 4:
        raise ValueError(f"perm layout: packed MXFP4 bytes with a last dim divisible by 4 expected, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    return _permute_bits(packed, inverse=False)


def _lanes_rows(rows: torch.Tensor) -> torch.Tensor:
    g = rows.reshape(*rows.shape[:-1], rows.shape[-1] // _GROUP_BYTES, 16, 4)
    return _permute_bits(g.transpose(-1, -2).reshape(rows.shape), inverse=False)


def _canonical_rows(rows: torch.Tensor) -> torch.Tensor:
    b = _permute_bits(rows, inverse=True)
    g = b.reshape(*rows.shape[:-1], rows.shape[-1] // _GROUP_BYTES, 4, 16)
    return g.transpose(-1, -2).reshape(rows.shape)


def _check(packed: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or packed.dim() < 1 or packed.shape[-1] % _GROUP_BYTES:
        raise ValueError(f"lanes layout: MXFP4 payload bytes (uint8) with a last dim divisible by {_GROUP_BYTES} "
                         f"(K a multiple of {LANES_GROUP_K}) expected, got {packed.dtype} {tuple(packed.shape)}")


def _rewrite(packed: torch.Tensor, fn, in_place: bool) -> torch.Tensor:
    _check(packed)
    out = packed if in_place else torch.empty_like(packed)
    flat_in = packed.reshape(-1, packed.shape[-1])
    flat_out = out.view(-1, packed.shape[-1])
    rows = max(1, _SLAB_BYTES // max(1, packed.shape[-1] * 8))
    for r in range(0, flat_in.shape[0], rows):
        flat_out[r:r + rows] = fn(flat_in[r:r + rows])
    return out


def to_lanes(packed: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """Canonical payload [..., N, K/2] -> the lanes layout (same shape and dtype). in_place rewrites `packed`
    (contiguous) slab by slab and returns it."""
    if in_place and not packed.is_contiguous():
        raise ValueError("lanes layout in place needs a contiguous payload")
    return _rewrite(packed, _lanes_rows, in_place)


def from_lanes(stored: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """The inverse of to_lanes."""
    if in_place and not stored.is_contiguous():
        raise ValueError("lanes layout in place needs a contiguous payload")
    return _rewrite(stored, _canonical_rows, in_place)


__all__ = ["to_lanes", "from_lanes", "perm_words"]
