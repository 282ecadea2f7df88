"""IR op -> the KernelSources that implement it on a target, for ahead-of-time compilation.

Each module registers `fn(op, module, target) -> list[KernelSource]` for the IR ops it lowers; the `codegen` pass
marks exactly the ops with a registered emitter `impl = "kernel"`. The KernelSources must be the ones the runtime
launches for the same shapes (both call the same `emit_*` functions), so the artifact holds the code that runs.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from ..kernel import KernelSource

EMITTERS: dict[str, Callable] = {}


def register_emitter(op_name: str):
    def deco(fn: Callable) -> Callable:
        EMITTERS[op_name] = fn
        return fn
    return deco


RUN_DTYPES = ("bf16", "f32")     # activation dtypes a session can run (the IR is bf16; fp32 weights run fp32)


def retyped(module, dtype: str):
    """`module` with its bf16 values (activations and float weights) in `dtype`: the graph a session runs with
    weights of that dtype, so emit_kernels(retyped(m, "f32"), t) is what an fp32 run launches."""
    from ...ir.core import TensorType

    if dtype == "bf16":
        return module
    ops = tuple(op.replace(types=tuple(TensorType(dtype if t.dtype == "bf16" else t.dtype, t.shape)
                                       for t in op.types)) for op in module.ops)
    return module.replace(ops=ops)


def catalogue_kernels(module, target, dtypes=("bf16",)) -> list[KernelSource]:
    """emit_kernels for every run dtype in `dtypes` (deduplicated by catalogue key)."""
    seen: dict[str, KernelSource] = {}
    for dt in dtypes:
        if dt not in RUN_DTYPES:
            from ...errors import ArgumentError

            raise ArgumentError(f"run dtype must be one of {', '.join(RUN_DTYPES)}, got {dt!r}")
        for ks in emit_kernels(retyped(module, dt), target):
            seen.setdefault(ks.key, ks)
    return list(seen.values())


def emit_kernels(module, target) -> list[KernelSource]:
    """Every distinct kernel of the module's `impl = "kernel"` ops (deduplicated by catalogue key: equal code
    emitted for two ops, whose header comments name different locations, is one kernel)."""
    seen: dict[str, KernelSource] = {}
    for op in module.ops:
        if op.attr("impl", None) != "kernel":
            continue
        emitter = EMITTERS.get(op.op)
        if emitter is None:
            from ...errors import IRError

            raise IRError("marked impl=kernel but no emitter is registered", op=op.describe(), loc=op.loc)
        for ks in emitter(op, module, target):
            seen.setdefault(ks.key, ks)
    return list(seen.values())


for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")
