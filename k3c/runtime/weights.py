"""Random weights for a spec: every canonical name (weight_names.model_weights) with its shape.

Random but non-degenerate, so every path of the reference is exercised: activations stay O(1) through each linear,
norm gains are not all one, AttnRes queries are non-zero (zero would make every depth softmax uniform and hide
bugs), the router bias changes selections, and KDA decays span weak to strong. Each tensor has its own generator
seeded from (seed, name): deterministic, and a weight does not change when unrelated parts of the spec do.
"""
from __future__ import annotations

import math
import zlib

import torch

from ..frontend.spec import ModelSpec
from ..frontend.weight_names import WeightInfo, model_weights


def _generator(seed: int, name: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator of its own per (seed, name). On a GPU the stream differs from the CPU's but is the same on every
    GPU of a kind (Philox), so ranks that each draw a full tensor and keep their slice agree with one GPU's run."""
    mixed = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (1 << 63)
    return torch.Generator(device=device).manual_seed(mixed)


def _normal(shape, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device)


def _uniform(shape, lo: float, hi: float, gen) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32, device=gen.device)


def _init_one(spec: ModelSpec, info: WeightInfo, gen: torch.Generator, shape=None) -> torch.Tensor:
    """`info`'s tensor, or with `shape` (rows of it flattened to [n, last]) the next rows its generator draws."""
    name, shape, kind = info.name, shape or info.shape, info.kind
    if kind in ("linear", "experts"):
        return _normal(shape, gen) / math.sqrt(shape[-1])                   # keeps activations O(1)
    if kind == "embedding":
        return _normal(shape, gen)
    if kind == "norm":
        return 1.0 + 0.1 * _normal(shape, gen)
    if kind == "conv":
        return _normal(shape, gen) / math.sqrt(shape[-1])
    if kind == "attnres":
        return 2.0 * _normal(shape, gen) / math.sqrt(shape[-1])             # depth scores O(1): softmax not flat
    if name.endswith("A_log"):
        # softplus gate: A in [1, 16] as Kimi Linear initialises it; safe gate: sharpness of the sigmoid
        lo, hi = (1.0, 16.0) if spec.kda.gate == "softplus" else (0.5, 2.0)
        return _uniform(shape, lo, hi, gen).log()
    if name.endswith("dt_bias"):
        if spec.kda.gate == "softplus":
            # Mamba-style: dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1] -> decays from ~1 to ~e^-5 per token
            dt = _uniform(shape, math.log(1e-3), math.log(1e-1), gen).exp()
            return dt + torch.log(-torch.expm1(-dt))                         # inverse softplus
        # safe gate: g = lb * sigmoid(a (f + dt_bias)); [-5, 1] gives g from ~-0.03 (weak) to ~-4 (strong)
        return _uniform(shape, -5.0, 1.0, gen)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * _normal(shape, gen)
    raise ValueError(f"no initialiser for weight {name} (kind {kind})")


def init_weights(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """{canonical name: tensor} for every weight of the spec; "fp32" entries stay fp32, the rest use `dtype`.
    On the CPU (default) meant for small specs; `device="cuda"` draws K3-width models in seconds (other values,
    see _generator)."""
    out = {}
    for info in model_weights(spec):
        t = _init_one(spec, info, _generator(seed, info.name, device))
        out[info.name] = t if info.dtype == "fp32" else t.to(dtype)
    return out


def init_weight_parts(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32, max_elements: int = 1 << 25):
    """init_weights' tensors one piece at a time, for checkpoints too large to draw whole: yields (name, part), a
    tensor of at most ~`max_elements` entries (the leading rows of its flattened [rows, last] view, in order, or
    the whole tensor in its own shape). Same values as init_weights: every part but the last of a tensor holds a
    multiple of 16 entries and the last at least 16, so torch's CPU normal draws (16 at a time, the last 16 of an
    uneven tensor drawn again) come out as for the whole tensor (tests/quant/test_quantize_stream.py checks)."""
    for info in model_weights(spec):
        gen = _generator(seed, info.name)
        want = torch.float32 if info.dtype == "fp32" else dtype
        total, last = math.prod(info.shape), info.shape[-1]
        rows = total // last
        step = max(1, max_elements // last)
        step = -(-step // 16) * 16 if last % 16 else step           # a part's entries: a multiple of 16
        if total <= max_elements or rows <= step:
            yield info.name, _init_one(spec, info, gen).to(want)
            continue
        start = 0
        while start < rows:
            n = min(step, rows - start)
            if 0 < rows - start - n and (rows - start - n) * last < 16:
                n = rows - start                                    # the last part at least 16 entries
            yield info.name, _init_one(spec, info, gen, (n, last)).to(want)
            start += n
