"""The op registry: every op the IR knows, by name, composed from the op families' OpDefs.

Each family module (k3c/ir/<family>_ops.py) exports `OP_DEFS`, a tuple of its OpDefs; FAMILIES lists the modules
and a name defined twice is an error. A new op goes into its family's file; a new family into FAMILIES.
`bind(op)` / `bind_inputs(...)` match an op's inputs to its roles (the one place that does).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping, Sequence

from ..errors import IRError
from . import attnres_ops, basic_ops, dist_ops, fused_ops, kda_ops, layer_ops, mla_ops, moe_ops
from .core import Op
from .opdef import OpDef

FAMILIES: tuple[ModuleType, ...] = (basic_ops, layer_ops, fused_ops, kda_ops, mla_ops, moe_ops, attnres_ops,
                                    dist_ops)


def compose_registry(families: Sequence[ModuleType]) -> dict[str, OpDef]:
    """Op name -> OpDef over the families' OP_DEFS; IRError naming both families when a name is defined twice."""
    out: dict[str, OpDef] = {}
    where: dict[str, str] = {}
    for family in families:
        for opdef in family.OP_DEFS:
            if opdef.name in out:
                raise IRError(f"op '{opdef.name}' is defined twice: by {where[opdef.name]} and by "
                              f"{family.__name__}")
            out[opdef.name] = opdef
            where[opdef.name] = family.__name__
    return out


_REGISTRY: dict[str, OpDef] = compose_registry(FAMILIES)


def get_op_def(name: str) -> OpDef | None:
    return _REGISTRY.get(name)


def registered_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def bind(op: Op) -> dict[str, str]:
    """Role name -> input value name of `op` (its OpDef's roles for its attrs, in input order): the one place an
    op's inputs are matched to what they mean."""
    return bind_inputs(op.op, op.attr_dict, op.inputs)


def bind_inputs(op_name: str, attrs: Mapping[str, Any], inputs: Sequence[str]) -> dict[str, str]:
    """bind() for inputs of an op not built yet (a pass about to rewrite it)."""
    opdef = get_op_def(op_name)
    if opdef is None:
        raise IRError(f"unknown op '{op_name}'")
    return {r.name: v for r, v in zip(opdef.roles(attrs), inputs)}
