"""Weights for a compiled graph: what the lowered IR's `param` ops need, checked and prepared once at load.

The IR decides which tensors a graph reads (passes change them: `mxfp4` turns a bf16 expert stack into packed
payload + scales, `shard` into one rank's slice), so weights are checked against the IR's params, never re-derived
from the spec. `prepare_weights` is the one place where load-time preparation happens; a failure names the weight
and what the graph expected, and nothing is moved to the device before every check passed.
"""
from __future__ import annotations

import torch

from ..errors import WeightError
from ..ir import Module

_FLOAT_DTYPES = ("f32", "bf16", "f16", "f64")


def graph_params(module: Module) -> dict[str, object]:
    """name -> TensorType of every weight the graph reads."""
    return {op.attr("name"): op.types[0] for op in module.ops if op.op == "param"}


def prepare_weights(module: Module, weights: dict[str, torch.Tensor], spec=None) -> dict[str, torch.Tensor]:
    """The subset of `weights` the graph reads, after load-time preparation, each checked against its param type.
    Raises WeightError for a missing weight or a wrong shape or dtype."""
    out: dict[str, torch.Tensor] = {}
    for name, ty in graph_params(module).items():
        t = weights.get(name)
        if t is None:
            raise WeightError(f"weight '{name}' is missing" + (f" for spec '{spec.name}'" if spec is not None else ""))
        want = tuple(ty.shape)
        if all(isinstance(d, int) for d in want) and tuple(t.shape) != want:
            raise WeightError(f"weight '{name}' has shape {tuple(t.shape)}, the graph needs {want}")
        if t.is_floating_point() != (ty.dtype in _FLOAT_DTYPES):       # float weights may be bf16 or f32
            raise WeightError(f"weight '{name}' has dtype {t.dtype}, the graph needs {ty.dtype}")
        out[name] = t
    return out
