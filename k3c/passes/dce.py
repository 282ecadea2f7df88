"""Dead-code elimination: drop ops none of whose results reaches a module output.

Kept regardless: `keep` ops (model inputs) and ops the registry does not know (their effects are unknown).
Counts: `removed_ops`, and `removed.<op>` per op kind.
"""
from __future__ import annotations

from collections import Counter

from ..ir.core import Module
from ..ir.ops import get_op_def
from .registry import PassContext, register_pass


def eliminate_dead(module: Module) -> tuple[Module, Counter]:
    """(module without dead ops, removed count per op kind). Returns the same module when nothing is dead.

    Other passes call this to clean up what their rewrites orphaned, since the verifier rejects dead ops.
    """
    live = set(module.outputs)
    kept = []
    removed: Counter[str] = Counter()
    for op in reversed(module.ops):
        opdef = get_op_def(op.op)
        if opdef is None or opdef.keep or any(r in live for r in op.results):
            kept.append(op)
            live.update(op.inputs)
        else:
            removed[op.op] += 1
    if not removed:
        return module, removed
    return module.replace(ops=tuple(reversed(kept))), removed


@register_pass("dce", ensures=("no-dead-ops",))
def dce(module: Module, ctx: PassContext) -> Module:
    """Remove ops whose results are never used."""
    out, removed = eliminate_dead(module)
    ctx.count("removed_ops", sum(removed.values()))
    for kind, n in sorted(removed.items()):
        ctx.count(f"removed.{kind}", n)
    return out
