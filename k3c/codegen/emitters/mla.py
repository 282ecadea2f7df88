"""Emitter of `mla_absorbed`: the kernels the runtime (k3c.runtime.kernels.mla) launches for it, with the same
emit_* arguments: the latent write (the one-kernel form for prefill; the split-K pair for decode and short appends:
partials with 16- and 64-row tiles, and the per-row reduce), the MQA split-KV decode for one query token per
sequence (all heads, the plan of k3c.codegen.kernels.mla.decode_plan), the LSE merges, and the MHA prefill step
(first chunk and continuation). Shapes the runtime meets later (speculative query lengths, other batch sizes) reuse
these kernels except the decode kernel's head tile, which follows the rows (tokens x heads) of the call, and the
prefill tiles for fewer than 128 query tokens."""
from __future__ import annotations

from ..kernels.mla import (decode_plan, emit_mla_decode, emit_mla_latent_partial, emit_mla_latent_reduce,
                           emit_mla_latent_write, emit_mla_merge, emit_mla_prefill)
from . import register_emitter

DTYPES = {"bf16": "bf16", "f32": "fp32", "f16": "fp16"}


@register_emitter("mla_absorbed")
def mla_absorbed(op, module, target):
    a = op.attr_dict
    x = module.type_of(op.inputs[0])
    dt = DTYPES[x.dtype]
    n, p, r, v, lat = (a["num_heads"], a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"],
                       a["kv_lora_rank"])
    d = x.shape[-1]
    wdkv = module.type_of(op.inputs[[rl.name for rl in _roles(a)].index("kv_a_proj_with_mqa.weight")])
    scale = float((p + r) ** -0.5)
    ps = target.mla_page_size
    kw = {"target": target, "ir_op": op.op, "loc": op.loc, "interpret": False}
    eps, wdt = float(a["lora_norm_eps"]), DTYPES[wdkv.dtype]
    # latent write: the one-kernel form (prefill) and the split-K pair (decode / short appends: partials for one
    # row tile of 16 (B*T <= 16) and of 64 rows (B*T <= 64), then the per-row reduce + RMSNorm + paged store)
    out = [emit_mla_latent_write(d, lat, r, eps, ps, dtype=dt, w_dtype=wdt, t_hint=1, **kw)]
    out += [emit_mla_latent_partial(d, lat + r, dtype=dt, w_dtype=wdt, rows_hint=m, **kw) for m in (1, 64)]
    out.append(emit_mla_latent_reduce(lat, r, eps, ps, w_dtype=wdt, cache_dtype=dt, **kw))
    plan = decode_plan(n, lat, target)
    bn = plan.block_n if plan.block_n and plan.block_n < ps and ps % plan.block_n == 0 else None
    out.append(emit_mla_decode(lat, r, ps, scale, dtype=dt, block_h=plan.block_h, num_warps=plan.num_warps,
                               num_stages=plan.num_stages, block_n=bn, keys_major=plan.keys_major,
                               lazy=plan.lazy, **kw))
    # the decode merges (whole rows for large batches, 64 columns a program for small ones) and the prefill one
    out += [emit_mla_merge(lat, out_dtype=dt, block_d=bd, write_lse=False, **kw) for bd in (None, 64)]
    out.append(emit_mla_merge(v, out_dtype="fp32", **kw))
    if not a.get("fold_uv_into_o_proj"):
        out += [emit_mla_prefill(p, r, v, scale, dtype=dt, has_prev=h, **kw) for h in (False, True)]
    return out


def _roles(a):
    from ...ir.mla_ops import absorbed_roles

    return absorbed_roles(a)
