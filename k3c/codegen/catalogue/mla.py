"""Emitter of `mla_absorbed`: every kernel the runtime (k3c.runtime.kernel_impls.mla) can launch for it, by the plan
rules it calls with the shapes at hand, each enumerated over its whole domain (codegen.kernels.mla.plan_classes):
the latent write (the one-kernel form; the split-K pair for B*T <= LATENT_SPLIT_MAX_ROWS: partials
per row class, and the per-row reduce), the MQA split-KV decode per row class (query tokens x heads; in the hopper
tier on targets that have it, kernels/mla_decode.py), its LSE merges
(every block the SM count can pick), the MHA prefill step per query-tile class (first chunk and continuation) and
its key-split merge. Each cache-facing kernel (latent writes' stores, the decode) comes in the model dtype's row
format and, for bf16 / fp16 models, in the fp8 one (kv_dtype is chosen at run time, per engine or session)."""
from __future__ import annotations

from ...ir.ops import bind
from ..kernels.common import ELEM_BYTES, IR_DTYPES
from ..kernels.mla import (LATENT_SPLIT_MAX_ROWS, TOKEN_CLASSES, decode_merge_blocks, decode_plan,
                           emit_mla_latent_partial, emit_mla_latent_reduce, emit_mla_latent_write, emit_mla_merge,
                           emit_mla_prefill, plan_classes, prefill_plan)
from ..kernels.mla_common import LATENT_FP8
from ..kernels.mla_decode import decode_kernel
from ..kernels.mla_latent import latent_split_plan


def mla_absorbed(op, module, target):
    a = op.attr_dict
    x = module.type_of(op.inputs[0])
    dt = IR_DTYPES[x.dtype]
    p, r, v, lat = (a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"],
                       a["kv_lora_rank"])
    d = x.shape[-1]
    wdkv = module.type_of(bind(op)["kv_a_proj_with_mqa.weight"])
    scale = float((p + r) ** -0.5)
    ps = target.mla_page_size
    kw = {"target": target, "ir_op": op.op, "loc": op.loc, "interpret": False}
    eps, wdt = float(a["lora_norm_eps"]), IR_DTYPES[wdkv.dtype]
    eb = max(ELEM_BYTES[dt], ELEM_BYTES[wdt])
    caches = (dt, LATENT_FP8) if dt != "fp32" else (dt,)
    out = [emit_mla_latent_write(d, lat, r, eps, ps, dtype=dt, w_dtype=wdt, cache_dtype=c, **kw) for c in caches]
    out += [emit_mla_latent_partial(d, lat + r, dtype=dt, w_dtype=wdt, rows_hint=m, **kw)
            for m in plan_classes(lambda m: latent_split_plan(m, d, eb, target),
                                  range(1, LATENT_SPLIT_MAX_ROWS + 1))]
    out += [emit_mla_latent_reduce(lat, r, eps, ps, w_dtype=wdt, cache_dtype=c, **kw) for c in caches]
    for c in caches:
        for rows in plan_classes(lambda m: decode_plan(m, lat, target, cache_dtype=c, rope_dim=r), TOKEN_CLASSES):
            out.append(decode_kernel(decode_plan(rows, lat, target, cache_dtype=c, rope_dim=r), lat, r, ps, scale,
                                     dtype=dt, cache_dtype=c, **kw))
    out += [emit_mla_merge(lat, out_dtype=dt, block_d=bd, write_lse=False, **kw) for bd in decode_merge_blocks(lat)]
    out.append(emit_mla_merge(v, out_dtype="fp32", **kw))
    out += [emit_mla_prefill(p, r, v, scale, dtype=dt, has_prev=h, tq_hint=tq, **kw)
            for tq in plan_classes(lambda tq: prefill_plan(tq, target), TOKEN_CLASSES) for h in (False, True)]
    return out


EMITTERS = {"mla_absorbed": mla_absorbed}
