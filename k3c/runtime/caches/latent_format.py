"""The MLA latent cache's row formats on the torch side: which pool dtype a `kv_dtype` names, the row width, and
the fp8 rows' encoding and decoding (the layout: k3c/codegen/kernels/mla_common.py's module doc; the kernels
write and read the same rows).

kv_dtype: "auto" (the activation dtype), "bf16", "fp16", "fp32", or "fp8" (OCP e4m3 codes with a per-token fp32
scale for the latent part and one for the rope part: 592 bytes per 576-value row instead of 1152 in bf16).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...codegen.kernels.mla_common import FP8_MAX, LATENT_FP8, latent_row_width
from ...errors import ArgumentError
from ..devices import TT_TO_TORCH

KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8")
_NAMED = {**{n: TT_TO_TORCH[n] for n in ("bf16", "fp16", "fp32")}, "fp8": TT_TO_TORCH["fp8e4nv"]}


@dataclass(frozen=True)
class KVFormat:
    """A decoded kv_dtype: the MLA latent cache's row format. kv_format() is the one place a kv_dtype name is
    read and checked; Engine, Session, the call context and DecodeGraph hold this value."""

    name: str

    def pool_dtype(self, act_dtype: torch.dtype, what: str = "kv_dtype") -> torch.dtype:
        """The pool tensor's dtype for a cache of this format in a model running in `act_dtype` (`what` names the
        argument in errors)."""
        if self.name == "fp8" and act_dtype == torch.float32:
            raise ArgumentError(f"{what} fp8 needs bf16 or fp16 activations (an fp32 run is the exact reference)")
        return act_dtype if self.name == "auto" else _NAMED[self.name]

    def __str__(self) -> str:
        return self.name


def kv_format(kv_dtype: object, what: str = "kv_dtype") -> KVFormat:
    """The KVFormat a user's kv_dtype names ("auto", "bf16", "fp16", "fp32", "fp8"; a KVFormat passes through);
    ArgumentError naming `what` otherwise."""
    if isinstance(kv_dtype, KVFormat):
        return kv_dtype
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise ArgumentError(f"{what} must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return KVFormat(kv_dtype)


AUTO = KVFormat("auto")     # the activation dtype


def is_fp8(pool: torch.Tensor | torch.dtype) -> bool:
    return (pool if isinstance(pool, torch.dtype) else pool.dtype) == torch.float8_e4m3fn


def row_width(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
    """Pool elements per cached token (any float dtype: a float64 torch run keeps L + R)."""
    return latent_row_width(kv_lora_rank, rope_dim, LATENT_FP8) if is_fp8(dtype) else kv_lora_rank + rope_dim


def pool_args(pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The pool as the kernels take it: (rows,) or, for fp8, (rows, the same memory as fp32 words)."""
    return (pool, pool.view(torch.float32)) if is_fp8(pool) else (pool,)


def encode_rows(rows: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., L+R] (any float dtype) in the pool format of `dtype`: a cast, or the fp8 codes and scales."""
    if not is_fp8(dtype):
        return rows.to(dtype)
    L, R = kv_lora_rank, rows.shape[-1] - kv_lora_rank
    width = latent_row_width(L, R, LATENT_FP8)
    out = torch.zeros(*rows.shape[:-1], width, dtype=torch.uint8, device=rows.device)
    scales = []
    for lo, hi in ((0, L), (L, L + R)):
        part = rows[..., lo:hi].float()
        amax = part.abs().amax(-1, keepdim=True)
        sc = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        out[..., lo:hi] = (part / sc).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        scales.append(sc)
    out[..., width - 8:] = torch.cat(scales, -1).contiguous().view(torch.uint8)
    return out.view(torch.float8_e4m3fn)


def decode_rows(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows [..., width] back to values [..., L+R] in `dtype` (fp8: code x its part's scale, in fp32)."""
    if not is_fp8(rows):
        return rows[..., :kv_lora_rank + rope_dim].to(dtype)
    L, R = kv_lora_rank, rope_dim
    raw = rows.view(torch.uint8)
    codes = raw[..., :L + R].view(torch.float8_e4m3fn).float()
    sc = raw[..., raw.shape[-1] - 8:].contiguous().view(torch.float32)          # [..., 2]
    return torch.cat([codes[..., :L] * sc[..., :1], codes[..., L:] * sc[..., 1:]], -1).to(dtype)


__all__ = ["KV_DTYPES", "KVFormat", "kv_format", "AUTO", "is_fp8", "row_width", "pool_args",
           "encode_rows", "decode_rows"]
