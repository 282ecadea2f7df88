"""The verifier: a module is well formed when every rule below holds. Errors name the op and its loc.

Rules: ops are registered; SSA (each value defined once, before use; outputs defined); no dead ops (an op none of
whose results is used or returned, except `keep` ops such as inputs); input count and weight roles match the op's
signature; attrs present, typed, no unknown ones; declared types use known dtypes and equal what the op's
inference rule derives; per-op rules (kda heads x head_dim vs weights, moe top_k <= experts, ...); a weight name
has one type, a model input name one op.
"""
from __future__ import annotations

import re
from typing import Iterator

from ..errors import IRError
from .core import DTYPE_BITS, Module, Op
from .opdef import TypeCheck
from .ops import bind, get_op_def, registered_ops

WEIGHT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")


def _err(op: Op, message: str) -> IRError:
    return IRError(message, op=op.describe(), loc=op.loc or None)


def verify(module: Module, *, allow_dead: bool = False) -> Module:
    """Raise IRError for the first problem; return the module unchanged when it is well formed."""
    for problem in iter_problems(module, allow_dead=allow_dead):
        raise problem
    return module


def check_module(module: Module, *, allow_dead: bool = False) -> list[IRError]:
    """Every problem found (each an IRError), in op order."""
    return list(iter_problems(module, allow_dead=allow_dead))


def iter_problems(module: Module, *, allow_dead: bool = False) -> Iterator[IRError]:
    defined: dict[str, Op] = {}
    later = module.defs               # to tell "used before its definition" from "never defined"
    param_types: dict[str, Op] = {}
    input_names: dict[str, Op] = {}
    for op in module.ops:
        problem = _check_op(op, defined, later)
        if problem is not None:
            yield problem
        for r in op.results:
            if r in defined:
                yield _err(op, f"redefines %{r} (first defined by {defined[r].describe()})")
            else:
                defined[r] = op
        if op.op == "param":
            name = op.attr("name", None)
            if isinstance(name, str):
                first = param_types.setdefault(name, op)
                if first.types != op.types:
                    yield _err(op, f"weight '{name}' has type {op.types[0]} here but {first.types[0]} at "
                                   f"{first.describe()}")
        elif op.op == "input":
            name = op.attr("name", None)
            if isinstance(name, str) and input_names.setdefault(name, op) is not op:
                yield _err(op, f"model input '{name}' is defined twice")
    for o in module.outputs:
        if o not in defined:
            yield IRError(f"module output %{o} is not defined", op="return")
    if not allow_dead:
        used = set(module.outputs)
        for op in module.ops:
            used.update(op.inputs)
        for op in module.ops:
            opdef = get_op_def(op.op)
            if opdef is not None and opdef.keep:
                continue
            if not any(r in used for r in op.results):
                yield _err(op, "is dead: none of its results is used or returned (run the 'dce' pass)")


def _check_op(op: Op, defined: dict[str, Op], later: dict[str, Op]) -> IRError | None:
    opdef = get_op_def(op.op)
    if opdef is None:
        known = ", ".join(sorted(registered_ops()))
        return _err(op, f"unknown op '{op.op}' (registered: {known})")
    for v in op.inputs:
        if v not in defined:
            if v in later and later[v] is not op:
                return _err(op, f"uses %{v} before its definition")
            return _err(op, f"uses undefined value %{v}")
    if len(op.results) != opdef.num_results:
        return _err(op, f"has {len(op.results)} results, '{op.op}' defines {opdef.num_results}")
    for t in op.types:
        if t.dtype not in DTYPE_BITS:
            return _err(op, f"unknown dtype '{t.dtype}' (known: {', '.join(DTYPE_BITS)})")

    # attributes: presence, types, no strays
    specs = opdef.all_attrs()
    attrs = op.attr_dict
    for key, spec in specs.items():
        if key not in attrs:
            if spec.required:
                return _err(op, f"missing attribute '{key}' ({spec.kind})")
            continue
        bad = spec.check(attrs[key])
        if bad:
            return _err(op, f"attribute '{key}': expected {bad}")
    for key in attrs:
        if key not in specs:
            return _err(op, f"unknown attribute '{key}' for '{op.op}' (allowed: {', '.join(sorted(specs))})")
    try:
        if opdef.check is not None:
            opdef.check(attrs)
    except TypeCheck as e:
        return _err(op, str(e))

    if op.op in ("param", "input") and not WEIGHT_NAME_RE.match(attrs["name"]):
        return _err(op, f"invalid {op.op} name {attrs['name']!r}")

    # inputs against the signature
    roles = opdef.roles(attrs)
    if len(op.inputs) != len(roles):
        names = ", ".join(r.name for r in roles) or "none"
        return _err(op, f"expects {len(roles)} inputs ({names}), got {len(op.inputs)}")
    for role, v in zip(roles, op.inputs):
        src = defined[v]
        if role.param and src.op == "param":
            wname = src.attr("name", "")
            if wname != role.name and not wname.endswith("." + role.name):
                return _err(op, f"input '{role.name}' is fed weight '{wname}' (%{v}); expected a weight named "
                                f"'*.{role.name}'")

    # types against the inference rule
    if opdef.infer is None:
        return None
    ins = {role: _type_in(defined[v], v) for role, v in bind(op).items()}
    try:
        inferred = tuple(opdef.infer(attrs, ins))
    except TypeCheck as e:
        return _err(op, str(e))
    if inferred != op.types:
        got = ", ".join(map(str, op.types)) or "none"
        want = ", ".join(map(str, inferred))
        return _err(op, f"declared type {got} but '{op.op}' infers {want}")
    return None


def _type_in(op: Op, value: str):
    return op.types[op.results.index(value)]
