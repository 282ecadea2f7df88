"""k3c: a compiler for Kimi-K3-class hybrid LLMs (KDA + gated MLA + Block AttnRes + LatentMoE + MXFP4).

    import k3c
    spec = k3c.load_spec("examples/k3-tiny.yaml")
    model = k3c.compile(spec, target="mi355x")
    w = k3c.init_weights(spec, seed=0)
    logits = k3c.reference_forward(spec, w, input_ids)
"""
__version__ = "0.1.0"

from .api import CompiledModel, compile, load  # noqa: E402,A004
from .frontend import load_spec  # noqa: E402


def init_weights(spec, seed: int = 0, dtype=None):
    """Random, non-degenerate weights for every canonical weight name of `spec`."""
    import torch

    from .runtime.weights import init_weights as _init

    return _init(spec, seed=seed, dtype=dtype or torch.float32)


def load_weights(spec, path, dtype=None):
    """Weights from safetensors: a Hugging Face model dir (Kimi Linear or K3 layout) or a .safetensors file."""
    from .runtime.checkpoint import load_weights as _load

    return _load(spec, path, dtype=dtype)


def reference_forward(spec, weights, input_ids):
    """Eager PyTorch semantics of the whole model: input ids [B, T] -> logits [B, T, vocab]."""
    from .reference import reference_forward as _ref

    return _ref(spec, weights, input_ids)


__all__ = ["load_spec", "compile", "load", "CompiledModel", "init_weights", "load_weights", "reference_forward",
           "__version__"]
