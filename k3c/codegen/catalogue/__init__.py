"""IR op -> the KernelSources that implement it on a target, for ahead-of-time compilation.

Each family module here exports `EMITTERS = {op_name: fn(op, module, target) -> list[KernelSource]}` for the IR ops
it lowers; EMITTERS below is their union, and the `codegen` pass marks exactly the ops it names `impl = "kernel"`.
The KernelSources must be the ones the runtime launches for the same shapes (both call the same `emit_*`
functions), so the artifact holds the code that runs.
"""
from __future__ import annotations

from typing import Callable

from ..kernel import KernelSource
from . import attnres, basic, kda, mla, moe, mxfp4

FAMILIES = (basic, kda, mla, attnres, moe)
"""The families that own their ops: no op name may appear in two of them."""

OVERRIDES = (mxfp4,)
"""Families whose entries take precedence over a base family's entry of the same op name. An op whose linear
weights the `mxfp4` pass may pack (lm_head, mlp, moe_linear) has two emitters: the float one in its own family
(basic.mlp, moe.moe_linear; lm_head has none, torch runs a float lm_head) and one in mxfp4.py that picks, from the
op's weight_format, the MXFP4 kernels or that float emitter (imported from its family by name). The composed table
must hold the one that picks, so the overrides are applied after the base families. No op name may appear in two
override families either."""


def compose(families, overrides) -> dict[str, Callable]:
    """The union of the families' EMITTERS tables, then the overrides' entries over it; ValueError for an op name
    defined twice among `families` or twice among `overrides`."""
    table: dict[str, Callable] = {}
    for group in (families, overrides):
        owner: dict[str, str] = {}
        for family in group:
            for name, fn in family.EMITTERS.items():
                if name in owner:
                    raise ValueError(f"emitter for op {name!r} defined by both {owner[name]} and {family.__name__}")
                owner[name] = family.__name__
                table[name] = fn
    return table


EMITTERS: dict[str, Callable] = compose(FAMILIES, OVERRIDES)

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

