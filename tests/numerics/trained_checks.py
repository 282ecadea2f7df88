"""What the numerics tests of the trained example model share: the size of the held-out sample, the checks and
their bounds, and bench/trained.py, whose execution paths they run (on the CPU).

Every bound was set from a measurement on examples/k3-stdlib (torch 2.13 CPU, the prompts and windows below), written
beside it: about 2-3x the deviation measured (fp32 paths: the size of an fp32 reordering, whatever this one measured). The injected-bug tests (test_injected_bugs.py) run the same checks
with the same bounds and assert that they fail.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "k3-stdlib"
if str(ROOT) not in sys.path:             # bench/ is a folder of scripts: import bench.trained by its package name
    sys.path.insert(0, str(ROOT))
trained = importlib.import_module("bench.trained")

needs_example = pytest.mark.skipif(not (EXAMPLE / "model.safetensors").exists(),
                                   reason="the trained example model is not in this checkout")

PROMPTS = 4               # the first lines of the first held-out files (>= 8 tokens each)
NEW_TOKENS = 16
WINDOWS, WINDOW_LEN = 8, 256       # held-out windows scored, each from a fresh context
TOPK = 5                  # check_logprobs_close: a differing token must be in the other side's top-5

# |perplexity / perplexity of reference-fp32 - 1| per path, over the WINDOWS above. Measured:
PPL_BOUNDS = {
    "compiled-fp32": 1e-5,      # 0 (fp32: the same nll to the last bit here)
    "tp2-ep2": 1e-5,            # 0 (fp32; 2e-7 on 4 windows of 128)
    "reference-bf16": 2.5e-3,   # +1.3e-4
    "compiled-bf16": 2.5e-3,    # +8.3e-4
    "prefix-resume": 2.5e-3,    # +8.3e-4 (bf16; every window's second half resumed from a checkpoint)
    "mxfp4": 3e-2,              # +1.35e-2 (bf16, routed experts in MXFP4; +3.0e-3 on 4 windows of 128)
    "fp8-kv": 3.5e-3,           # +1.12e-3 (bf16 with the fp8 latent cache; compiled-bf16 measured +8.3e-4 beside it)
}
# relative L2 error of the prefill logits over the WINDOWS (one 16-token window for the kernels). Measured:
LOGITS_BOUNDS = {
    ("reference-bf16", "reference-fp32"): 3e-2,              # 1.46e-2 (9.2e-3 on 4 windows of 128)
    ("compiled-bf16", "reference-bf16"): 2.5e-2,             # 1.21e-2 (9.2e-3 on 4 windows of 128)
    ("compiled-bf16 kernels", "reference-bf16"): 1.5e-2,     # 5.5e-3
    ("mxfp4", "mxfp4 oracle"): 2.5e-2,                       # 1.06e-2
    ("fp8-kv kernels", "compiled-bf16 kernels"): 3e-2,       # 1.21e-2 (the fp8 cache's rounding; one 16-token window)
    ("fp8-kv kernels", "fp8-kv"): 1.5e-2,                    # 7.4e-3 (kernels and torch ops on the same fp8 rows)
}
LOGPROBS_BOUND_FP32 = 1e-5    # rel L2 of each greedy step's log-probabilities, fp32 kernels: measured 1.1e-7


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside: these runs are thousands of small ops, which two OpenMP threads on a busy 2-core
    machine make 10-30x slower (measured: 12 greedy tokens of the compiled graph, 48 s on two threads, 1.8 s on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def agreements(ref: list, other: list) -> list:
    """check_logprobs_close of every prompt's generation against the reference's."""
    assert len(ref) == len(other)
    return [trained.check_logprobs_close(r, o, TOPK) for r, o in zip(ref, other)]


def describe(ags: list) -> str:
    return "; ".join(a.detail for a in ags)


def ppl_change(nll: float, ref_nll: float) -> float:
    """perplexity / reference perplexity - 1."""
    return math.expm1(nll - ref_nll)


def window_logits(path: str, windows: torch.Tensor, *, kernels: bool, weights: dict | None = None) -> torch.Tensor:
    """Logits [N, T, V] fp32 of the windows' inputs through `path` (bench/trained.py's scoring path), on the CPU."""
    return torch.cat(list(trained.window_logits(path, windows, device="cpu", model_dir=EXAMPLE, weights=weights,
                                                 kernels=kernels, batch=windows.shape[0])))


def checkpoint() -> tuple:
    """(spec, weights as the checkpoint stores them) of the example model."""
    import k3c

    spec = k3c.load_spec(EXAMPLE)
    return spec, k3c.load_weights(spec, EXAMPLE)


def mxfp4_oracle_weights() -> dict:
    """The checkpoint with its routed experts replaced by their MXFP4 values under the spec's scale rule
    (quantized and dequantized by k3c.quant, bf16): what the mxfp4 path must compute with."""
    from k3c.quant import mxfp4_dequantize, mxfp4_quantize

    spec, weights = checkpoint()
    rule = spec.precision.weights.scale_rule
    out = dict(weights)
    for name, t in weights.items():
        if ".block_sparse_moe.experts." in name:
            out[name] = mxfp4_dequantize(*mxfp4_quantize(t, rule), torch.bfloat16)
    return out
