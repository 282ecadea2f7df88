"""Where Triton runs in this process: compiled on a GPU, or in the interpreter on a CPU.

Triton decides at import time whether its own @jit helpers (the combine functions behind tl.sum, tl.max, ...) are
interpreted: a process that imported triton without TRITON_INTERPRET=1 cannot run kernels that call them in the
interpreter. So a CPU process must import triton in interpreter mode first; `prepare_interpreter()` does that, and
says clearly when it is too late. (AOT compilation never runs in such a process: k3c.codegen.aot uses spawned
workers with a clean environment.)
"""
from __future__ import annotations

import os
import sys

from ..errors import K3cError


def prepare_interpreter() -> None:
    """Import triton in interpreter mode unless it is already imported in that mode."""
    if "triton" in sys.modules:
        if not interpreter_ready():
            raise K3cError("triton was imported in this process without TRITON_INTERPRET=1, so its built-in "
                           "@jit helpers cannot run in the interpreter; set TRITON_INTERPRET=1 before anything "
                           "imports triton (or import k3c.runtime.devices first) to run kernels on a CPU")
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def interpreter_ready() -> bool:
    """True when triton's standard-library jit functions were defined for the interpreter."""
    try:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    fn = getattr(standard, "_sum_combine", None)
    return fn is None or isinstance(fn, InterpretedFunction)
