"""Packed MXFP4 expert stacks as the eager reference reads them: `stack[e]` dequantizes one expert on demand.

The reference MoE (k3c/reference/moe.py) indexes `w1[e]` only for experts that received tokens and reads
`w2.shape`, so a packed stack runs there without dequantizing all E experts at once (K3-wide: 8.4 GB per layer in
bf16, against 2.2 GB packed).
"""
from __future__ import annotations

import torch

from .mx import BLOCK_SIZE, mxfp4_dequantize


class MXFP4Stack:
    """A [E, out, in] weight held as MXFP4 payload u8 [E, out, in/2] + E8M0 scales u8 [E, out, in/32]."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                 name: str = "weight"):
        if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise TypeError(f"{name}: packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
        if packed.dim() < 2 or tuple(scales.shape) != (*packed.shape[:-1], packed.shape[-1] * 2 // BLOCK_SIZE) \
                or (packed.shape[-1] * 2) % BLOCK_SIZE:
            raise ValueError(f"{name}: scales {tuple(scales.shape)} do not fit packed {tuple(packed.shape)} "
                             f"(blocks of {BLOCK_SIZE} along the last dimension)")
        self.packed, self.scales, self.dtype = packed, scales, dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    def __len__(self) -> int:
        return self.packed.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        return mxfp4_dequantize(self.packed[index], self.scales[index], self.dtype)

    def dequantize(self) -> torch.Tensor:
        """Every expert at once: [E, out, in] in self.dtype."""
        return mxfp4_dequantize(self.packed, self.scales, self.dtype)
