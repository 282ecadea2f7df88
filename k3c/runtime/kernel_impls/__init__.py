"""Runtime implementations of the kernel-level ops, one module per kernel family. Each family exports two plain
dicts of `fn(attrs, cache, data, params)`:

    KERNEL_IMPLS  {op name: launch_<op>}  the op through its generated Triton kernels, on the device of its tensors,
                                           planned for and launched through the call's Binding
                                           (caches.context.call_binding(cache): the model's artifact and Target;
                                           the interpreter on a CPU); the executor takes it for ops the `codegen`
                                           pass marks impl="kernel"
    TORCH_IMPLS   {op name: torch_<op>}   the torch path (the reference) of the ops the family's passes introduce;
                                           the layer ops' torch path is the executor's own table

The tables below are their union over FAMILIES (an op name in two families is an error), with the OVERRIDES
families' entries on top (the AOT side, k3c/codegen/catalogue, composes its emitters the same way).
"""
from __future__ import annotations

from typing import Callable

from . import attnres, basic, kda, mla, moe, mxfp4_linear

FAMILIES = (basic, kda, mla, attnres, moe)
"""The families that own their ops: no op name may appear in two of them."""

OVERRIDES = (mxfp4_linear,)
"""Families whose entries replace a base family's entry of the same op name. An op whose linear weights the
`mxfp4` pass may pack (weight_format "mxfp4": lm_head, mlp, moe_linear) keeps its one op name, so one table entry
serves both forms: mxfp4_linear's entry reads the op's attrs and calls either the float family's function
(imported from that family by name: still the one place of the float path) or the MXFP4 one. Refusing the name
would make the float families know about MXFP4; last-one-wins among all families would hide real clashes. No op
name may appear in two override families either."""


def compose(families, overrides, table: str) -> dict[str, Callable]:
    """The union of the families' `table` dicts ("KERNEL_IMPLS" or "TORCH_IMPLS"), then the overrides' entries
    over it; ValueError for an op name defined twice among `families` or twice among `overrides`."""
    out: dict[str, Callable] = {}
    for group in (families, overrides):
        owner: dict[str, str] = {}
        for family in group:
            for name, fn in getattr(family, table).items():
                if name in owner:
                    raise ValueError(f"{table} entry for op {name!r} defined by both {owner[name]} and "
                                     f"{family.__name__}")
                owner[name] = family.__name__
                out[name] = fn
    return out


KERNEL_IMPLS: dict[str, Callable] = compose(FAMILIES, OVERRIDES, "KERNEL_IMPLS")
TORCH_IMPLS: dict[str, Callable] = compose(FAMILIES, OVERRIDES, "TORCH_IMPLS")
