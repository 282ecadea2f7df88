"""Helpers of the reference-semantics tests (a uniquely named module: tests/ has no packages)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
from functools import cache
from pathlib import Path

import pytest
import torch

from k3c.reference import ReferenceModel


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=gen(seed))


def rand_ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=gen(seed))


@cache
def _fla_naive_module():
    # Load fla/ops/kda/naive.py by path: importing the `fla` package is off limits (another test sets
    # sys.modules["fla"] = None so transformers does not pick fla's GPU kernels); naive.py needs only torch/einops.
    try:
        spec = importlib.util.find_spec("fla")
    except (ValueError, ImportError):
        spec = None
    if spec is None:                                   # sys.modules["fla"] is None: search the path directly
        spec = importlib.machinery.PathFinder.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.is_file():
        return None
    mspec = importlib.util.spec_from_file_location("_k3c_test_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


def fla_naive():
    mod = _fla_naive_module()
    if mod is None:
        pytest.skip("fla-core (fla/ops/kda/naive.py) is not installed")
    return mod


def record_sublayers(model: ReferenceModel) -> list:
    """Wrap the model's sublayers to record (input, output) of each, in order."""
    rec, attn, ffn = [], model.attention, model.feed_forward

    def attention(i, x, cache):
        y, c = attn(i, x, cache)
        rec.append((x, y))
        return y, c

    def feed_forward(i, x):
        y = ffn(i, x)
        rec.append((x, y))
        return y

    model.attention, model.feed_forward = attention, feed_forward
    return rec
