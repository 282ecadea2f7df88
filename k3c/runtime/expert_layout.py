"""The hopper layout of routed MXFP4 expert stacks (k3c.codegen.kernels.moe_hopper states it and why): the routed
experts' load-time layout on sm_90 targets, made by weight preparation (k3c.runtime.weight_prep) and read back by the
torch implementations. to_hopper / from_hopper (payload) and to_hopper_scales / from_hopper_scales are bit-exact
inverses, per expert matrix, a slab of experts at a time (bounded temporaries for K3's stacks), in place or not."""
from __future__ import annotations

import functools

import torch

from ..codegen.kernels.moe_hopper import HOPPER_K, HOPPER_ROWS
from ..codegen.kernels.moe_lanes import pairs_perm_bit_map

_SLAB_BYTES = 1 << 26       # bytes rewritten per step


@functools.lru_cache(maxsize=None)
def _byte_tables(inverse: bool) -> tuple[tuple[int, ...], ...]:
    """Four 256-entry tables, one per byte k of a word: the 32-bit contribution of each value of that byte in the
    stored (perm) order, or (inverse) in the canonical order from a stored word."""
    stored_to_canon = pairs_perm_bit_map()
    if inverse:
        place = stored_to_canon                          # stored bit b -> canonical bit
    else:
        place = [0] * 32
        for stored, canon in enumerate(stored_to_canon):
            place[canon] = stored                        # canonical bit -> stored bit
    return tuple(tuple(sum(((v >> t) & 1) << place[8 * k + t] for t in range(8)) for v in range(256))
                 for k in range(4))


def _permute_bits(b: torch.Tensor, inverse: bool) -> torch.Tensor:
    """u8 [..., 4m] -> the same bytes with each aligned word's bits moved (forward: canonical -> perm)."""
    tables = [torch.tensor(t, dtype=torch.int64, device=b.device) for t in _byte_tables(inverse)]
    w = b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4).to(torch.int64)
    out = tables[0][w[..., 0]] | tables[1][w[..., 1]] | tables[2][w[..., 2]] | tables[3][w[..., 3]]
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=b.device)
    return ((out[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(b.shape)


# -- the hopper layout (moe_hopper): per expert matrix, bytes rearranged (and the payload's words bit-permuted) ----
# payload [N, K/2]: (B, h, s, p | t, j, i, c) <-> stored (B, s | t, p, c, j, i, h); scales [N, K/32]: (R, h, g | m, a)
# <-> (R | m, g, a, h)
_VALUE_DIMS = (16, 2, 4, 2), (32, 4, 2, 4)        # (rows per B: h, s, p), (bytes per t: j, i, c)
_V_TO = (0, 2, 4, 3, 7, 5, 6, 1)                    # canonical (B, h, s, p, t, j, i, c) -> (B, s, t, p, c, j, i, h)
_S_TO = (0, 3, 2, 4, 1)                             # canonical (R, h, g, m, a) -> (R, m, g, a, h)


def _inverse(order):
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return tuple(inv)


def _hopper_check(t: torch.Tensor, what: str, per_row: int) -> tuple[int, int]:
    """(N, row bytes) of a payload (per_row = 2: K/2 bytes) or scale (per_row = 32: K/32) stack [..., N, K/per_row]."""
    if t.dtype != torch.uint8 or t.dim() < 2:
        raise ValueError(f"hopper layout: MXFP4 {what} bytes (uint8, [..., N, K/{per_row}]) expected, got {t.dtype} "
                         f"{tuple(t.shape)}")
    n, cols = t.shape[-2], t.shape[-1]
    if n % HOPPER_ROWS or (cols * per_row) % HOPPER_K:
        raise ValueError(f"hopper layout: N a multiple of {HOPPER_ROWS} and K of {HOPPER_K} needed, got {what} "
                         f"{tuple(t.shape)} (N {n}, K {cols * per_row})")
    return n, cols


def _values_to(m: torch.Tensor, inverse: bool) -> torch.Tensor:
    """[E', N, K/2] matrices, canonical <-> stored order (bytes; the bit step is apart)."""
    e, n, kb = m.shape
    if not inverse:
        v = m.reshape(e, n // 16, 2, 4, 2, kb // 32, 4, 2, 4)
        return v.permute(0, *(1 + d for d in _V_TO)).reshape(e, n, kb)
    v = m.reshape(e, n // 16, 4, kb // 32, 2, 4, 4, 2, 2)      # (B, s, t, p, c, j, i, h)
    return v.permute(0, *(1 + d for d in _inverse(_V_TO))).reshape(e, n, kb)


def _scales_to(m: torch.Tensor, inverse: bool) -> torch.Tensor:
    e, n, kc = m.shape
    if not inverse:
        v = m.reshape(e, n // 16, 2, 8, kc // 2, 2)
        return v.permute(0, *(1 + d for d in _S_TO)).reshape(e, n, kc)
    v = m.reshape(e, n // 16, kc // 2, 8, 2, 2)                # (R, m, g, a, h)
    return v.permute(0, *(1 + d for d in _inverse(_S_TO))).reshape(e, n, kc)


def _by_expert(t: torch.Tensor, fn, in_place: bool) -> torch.Tensor:
    """fn over [E', N, cols] slabs of whole expert matrices (bounded temporaries), in place or into a new tensor."""
    if in_place and not t.is_contiguous():
        raise ValueError("hopper layout in place needs a contiguous tensor")
    n, cols = t.shape[-2], t.shape[-1]
    flat_in = t.reshape(-1, n, cols)
    out = t if in_place else torch.empty_like(t)
    flat_out = out.view(-1, n, cols)
    step = max(1, _SLAB_BYTES // max(1, n * cols * 8))
    for e in range(0, flat_in.shape[0], step):
        part = fn(flat_in[e:e + step])
        if in_place and part.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            part = part.clone()         # a view of the input (a permutation of size-1 dims): copy before writing
        flat_out[e:e + step] = part
    return out


def to_hopper(packed: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """Canonical payload [..., N, K/2] -> the hopper layout (same shape and dtype; each matrix's bytes rearranged,
    each stored word's bits in the perm order)."""
    _hopper_check(packed, "payload", 2)
    return _by_expert(packed, lambda m: _permute_bits(_values_to(m, False), inverse=False), in_place)


def from_hopper(stored: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """The inverse of to_hopper: the canonical (k3c.quant / OCP) payload, bit for bit."""
    _hopper_check(stored, "payload", 2)
    return _by_expert(stored, lambda m: _values_to(_permute_bits(m, inverse=True), True), in_place)


def to_hopper_scales(scales: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """Canonical E8M0 scales [..., N, K/32] -> the hopper scale layout (same shape)."""
    _hopper_check(scales, "scale", 32)
    return _by_expert(scales, lambda m: _scales_to(m, False), in_place)


def from_hopper_scales(stored: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """The inverse of to_hopper_scales."""
    _hopper_check(stored, "scale", 32)
    return _by_expert(stored, lambda m: _scales_to(m, True), in_place)


__all__ = ["to_hopper", "from_hopper", "to_hopper_scales", "from_hopper_scales"]
