"""`k3c plan` on a sharded IR (the `shard` pass ran: module attrs tp, ep, rank; docs/distributed.md).

The planner's formulas take whole-model op attrs (heads, experts) and a ParallelLayout; a rank's IR holds local
param shapes and local head counts. `unshard_view` gives the planner the whole model back (param types times their
split, head counts times TP) while each param keeps its `shard` annotation, which classify_params then reads as the
param's split and per-GPU share: the plan follows what the runtime really holds (e.g. embeddings and the latent
projections replicated), not the planner's default assumptions.
"""
from __future__ import annotations

import re

from ..errors import ArgumentError
from ..ir.core import Module
from .layout import ParallelLayout

_LAYER_ATTN = re.compile(r"layers\.(\d+)\.self_attn\.")
_PACKED = (".weight_packed", ".weight_scale")


def is_sharded(module: Module) -> bool:
    a = module.attr_dict
    return "tp" in a or "ep" in a


def sharded_layout(module: Module, tp: int | None = None, ep: int | None = None) -> ParallelLayout:
    """The module's own layout; ArgumentError if --tp / --ep were given and disagree with it."""
    a = module.attr_dict
    lay = ParallelLayout.make(int(a.get("tp", 1)), int(a.get("ep", 1)))
    for name, given, have in (("--tp", tp, lay.tp), ("--ep", ep, lay.ep)):
        if given is not None and given != have:
            raise ArgumentError(f"{name} {given}: this IR was sharded for TP {lay.tp} x EP {lay.ep} "
                                f"(rank {a.get('rank', 0)}); drop {name} or plan the unsharded model")
    return lay


def unshard_view(module: Module) -> Module:
    """Whole-model types and head counts, shard annotations kept (for analysis only: not a valid IR)."""
    from ..passes.shard import parse_shard

    a = module.attr_dict
    tp, ep, rank = int(a.get("tp", 1)), int(a.get("ep", 1)), int(a.get("rank", 0))
    # attention layers whose heads the pass split: those with a TP-split self_attn weight
    split_layers = set()
    for op in module.ops:
        s = parse_shard(op.attr("shard", "") or "") if op.op == "param" else None
        m = _LAYER_ATTN.match(op.attr("name", "") or "") if s is not None and s[0] == "tp" else None
        if m:
            split_layers.add(int(m.group(1)))
    ops = []
    for op in module.ops:
        if op.op == "param":
            s = parse_shard(op.attr("shard", "") or "")
            name = op.attr("name")
            if s is None and ep > 1 and ".experts." in name and name.endswith(_PACKED):
                # packed by a later pass (mxfp4) from an EP-split stack: the same expert split
                s = ("ep", 0, rank % ep, ep)
                op = op.with_attrs(shard=f"ep:0:{rank % ep}/{ep}")
            if s is not None:
                shape = list(op.type.shape)
                shape[s[1]] *= s[3]
                op = op.replace(types=(op.type.with_shape(shape),))
        elif op.attr("layer", None) in split_layers and isinstance(op.attr("num_heads", None), int):
            op = op.with_attrs(num_heads=op.attr("num_heads") * tp)
        ops.append(op)
    return module.replace(ops=tuple(ops))
