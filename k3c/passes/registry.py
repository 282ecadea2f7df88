"""Pass and invariant registries.

A pass is a pure function `fn(module, ctx) -> Module`, registered once by name:

    @register_pass("dce", ensures=("no-dead-ops",))
    def dce(module: Module, ctx: PassContext) -> Module: ...

`ctx.count(key)` records rewrite counts (tests assert a rewrite fired); `ctx.walk(ops)` iterates ops while
remembering the current one, so an exception inside the pass is reported against that op; `ctx.target` is the
compile target run_pipeline was given (`ctx.plan_target`: it, or the default compile target). `ensures` names
invariants (registered below with `@register_invariant`) that the pipeline checks after the pass, on top of the
verifier.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from ..codegen.targets import DEFAULT_TARGET, Target, get_target
from ..errors import ArgumentError, IRError
from ..ir.core import Module, Op, attrs_key
from ..ir.ops import get_op_def


class PassContext:
    """What a running pass reports (rewrite counts, the op it is working on) and what it compiles for: `target`,
    the compile target (a k3c.codegen.targets.Target; None = the default compile target, DEFAULT_TARGET).
    A pass that chooses tiles or plans reads `ctx.plan_target` (the Target, never None)."""

    def __init__(self, name: str, target: Target | None = None):
        self.name = name
        self.target = target
        self.counts: Counter[str] = Counter()
        self.current_op: Op | None = None

    @property
    def plan_target(self) -> Target:
        """`target`, or the default compile target's row when it is None."""
        return self.target if self.target is not None else get_target(DEFAULT_TARGET)

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def walk(self, ops: Iterable[Op]) -> Iterator[Op]:
        for op in ops:
            self.current_op = op
            yield op
        self.current_op = None


PassFn = Callable[[Module, PassContext], Module]


@dataclass(frozen=True)
class PassInfo:
    name: str
    fn: PassFn
    ensures: tuple[str, ...] = ()
    doc: str = ""


_PASSES: dict[str, PassInfo] = {}
InvariantFn = Callable[[Module], "IRError | None"]
_INVARIANTS: dict[str, InvariantFn] = {}


PASS_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_\-]*\Z")     # also a dump file name part


def register_pass(name: str, *, ensures: Iterable[str] = (), doc: str | None = None) -> Callable[[PassFn], PassFn]:
    if not PASS_NAME_RE.match(name):
        raise ValueError(f"invalid pass name {name!r}: use lower-case letters, digits, '-' and '_'")

    def wrap(fn: PassFn) -> PassFn:
        if name in _PASSES and _PASSES[name].fn is not fn:
            raise ValueError(f"pass '{name}' is already registered")
        _PASSES[name] = PassInfo(name, fn, tuple(ensures), (doc or fn.__doc__ or "").strip().split("\n")[0])
        return fn
    return wrap


def registered_passes() -> dict[str, PassInfo]:
    return dict(_PASSES)


def get_pass(name: str) -> PassInfo:
    """The pass registered as `name`; ArgumentError listing the valid passes otherwise."""
    if name not in _PASSES:
        raise ArgumentError(f"unknown pass '{name}'; valid passes: {', '.join(sorted(_PASSES))}")
    return _PASSES[name]


def register_invariant(name: str) -> Callable[[InvariantFn], InvariantFn]:
    def wrap(fn: InvariantFn) -> InvariantFn:
        _INVARIANTS[name] = fn
        return fn
    return wrap


def check_invariant(name: str, module: Module) -> IRError | None:
    if name not in _INVARIANTS:
        raise ArgumentError(f"unknown invariant '{name}'; known: {', '.join(sorted(_INVARIANTS))}")
    return _INVARIANTS[name](module)


# ---- invariants shared by several passes -----------------------------------------------------------------
def _err(op: Op, message: str) -> IRError:
    return IRError(message, op=op.describe(), loc=op.loc or None)


@register_invariant("no-dead-ops")
def _no_dead_ops(module: Module) -> IRError | None:
    used = set(module.outputs)
    for op in module.ops:
        used.update(op.inputs)
    for op in module.ops:
        opdef = get_op_def(op.op)
        if not (opdef is not None and opdef.keep) and not any(r in used for r in op.results):
            return _err(op, "is dead after a pass that ensures no-dead-ops")
    return None


@register_invariant("unique-params")
def _unique_params(module: Module) -> IRError | None:
    seen: dict[str, Op] = {}
    for op in module.ops:
        if op.op == "param":
            name = op.attr("name", None)
            if name in seen:
                return _err(op, f"weight '{name}' is declared again (first by {seen[name].describe()})")
            seen[name] = op
    return None


def cse_key(op: Op) -> tuple | None:
    """What makes two ops interchangeable: op, inputs, attrs and types (not names, not loc). None: not pure."""
    opdef = get_op_def(op.op)
    if opdef is None or not opdef.pure or not op.results:
        return None
    return (op.op, op.inputs, attrs_key(op.attrs), op.types)


@register_invariant("no-common-subexpressions")
def _no_common_subexpressions(module: Module) -> IRError | None:
    seen: dict[tuple, Op] = {}
    for op in module.ops:
        key = cse_key(op)
        if key is None:
            continue
        if key in seen:
            return _err(op, f"computes the same as {seen[key].describe()}")
        seen[key] = op
    return None
