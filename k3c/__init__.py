"""k3c: a compiler for Kimi-K3-class hybrid LLMs (KDA + gated MLA + Block AttnRes + LatentMoE + MXFP4).

    import k3c
    spec = k3c.load_spec("examples/k3-tiny.yaml")
    model = k3c.compile(spec, target="mi355x")
    w = k3c.init_weights(spec, seed=0)
    logits = k3c.reference_forward(spec, w, input_ids)

The names below load their modules on first use: `import k3c.ir` (or any lower layer, docs/layout.md) runs only
that layer's code, and compiling never imports torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute)
_PUBLIC = {
    "load_spec": ("k3c.frontend", "load_spec"),
    "compile": ("k3c.api", "compile"),
    "load": ("k3c.api", "load"),
    "CompiledModel": ("k3c.api", "CompiledModel"),
    "init_weights": ("k3c.runtime.weights", "init_weights"),
    "load_weights": ("k3c.runtime.checkpoint", "load_weights"),
    "reference_forward": ("k3c.reference", "reference_forward"),
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'k3c' has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_PUBLIC})
