"""Runtime implementations of ops the `codegen` pass marks `impl = "kernel"`: each module registers, per IR op,
a function `fn(attrs, cache, data, params)` that launches the generated Triton kernels (k3c.codegen.launch) on the
device of its tensors (through the interpreter on a CPU). One module per kernel family; every module in this
package is imported, so a new family registers itself."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

KERNEL_IMPLS: dict[str, Callable] = {}


def register_kernel_impl(op_name: str):
    """Decorator: `fn(attrs, cache, data, params)` runs `op_name` through generated kernels."""
    def deco(fn: Callable) -> Callable:
        KERNEL_IMPLS[op_name] = fn
        return fn
    return deco


for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_mod}")
