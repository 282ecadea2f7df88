"""AOT emitters of the two-phase Block AttnRes ops: the same emit_* calls the runtime makes
(k3c/runtime/kernel_impls/attnres.py), specialised on the op's hidden size, source/query counts and dtypes. Phase 1
has two forms, both emitted: the row-tile pair (prefill) and the D-split pair (decode: up to SPLIT_MAX_M rows)."""
from __future__ import annotations

from ...ir.attnres_ops import STATS
from ..kernels.attnres import emit_attnres_phase1, emit_attnres_phase1_split, emit_attnres_phase2
from ..kernels.common import IR_DTYPES


def _dt(t, op) -> str:
    from ...errors import IRError

    if t.dtype not in IR_DTYPES:
        raise IRError(f"no AttnRes kernel for dtype {t.dtype}", op=op.describe(), loc=op.loc)
    return IR_DTYPES[t.dtype]


def emit_phase1(op, module, target):
    t = op.types[0]
    d = t.shape[-1] - STATS
    args = (d, op.attr("num_sources"), op.attr("num_queries"), op.attr("eps"))
    kw = dict(target=target, dtype=_dt(t, op), loc=op.loc)
    return list(emit_attnres_phase1(*args, **kw)) + list(emit_attnres_phase1_split(*args, **kw))


def emit_phase2(op, module, target):
    t = module.types[op.inputs[0]]
    d = t.shape[-1] - STATS
    normed = op.attr("normed")
    wdt = _dt(module.types[op.inputs[-1]], op) if normed else None
    return [emit_attnres_phase2(d, op.attr("eps"), mode=op.attr("mode"), normed=normed,
                                norm_eps=op.attr("norm_eps", None), target=target, dtype=_dt(t, op),
                                weight_dtype=wdt, loc=op.loc)]


def emit_take(op, module, target):
    """A view of the phase-2 result: no kernel to launch."""
    return []


EMITTERS = {"attn_res_phase1": emit_phase1, "attn_res_phase2": emit_phase2, "attn_res_take": emit_take}
