"""The MQA split-KV decode kernel of a DecodePlan: the one place that turns a plan into a KernelSource, called by the
AOT catalogue (codegen/catalogue/mla.py) and the runtime (runtime/kernel_impls/mla.py) alike, so what the artifact
holds is what the runtime looks up, in either tier."""
from __future__ import annotations

from dataclasses import replace

from ..kernel import KernelSource
from ..targets import Target
from ..tiers import tier_of
from .mla import DecodePlan, emit_mla_decode
from .mla_hopper import emit_mla_decode_hopper


def decode_kernel(plan: DecodePlan, kv_lora_rank: int, rope_dim: int, page_size: int, scale: float, *,
                  target: Target, dtype: str, cache_dtype: str, interpret: bool | None = None,
                  ir_op: str = "mla_absorbed", loc: str = "") -> KernelSource:
    """The decode kernel `plan` names: the hopper tier's Gluon kernel, or the portable one with the plan's tiles."""
    if plan.tier != "portable":
        tier = tier_of(plan.tier)
        ks = emit_mla_decode_hopper(kv_lora_rank, rope_dim, page_size, scale, target=target, dtype=dtype,
                                    cache_dtype=cache_dtype, ir_op=ir_op, loc=loc)
        return replace(ks, tier=tier.name, builds_with=tier.builds_with)
    bn = plan.block_n if plan.block_n and plan.block_n < page_size and page_size % plan.block_n == 0 else None
    return emit_mla_decode(kv_lora_rank, rope_dim, page_size, scale, target=target, dtype=dtype,
                           cache_dtype=cache_dtype, block_h=plan.block_h, num_warps=plan.num_warps,
                           num_stages=plan.num_stages, block_n=bn, keys_major=plan.keys_major, lazy=plan.lazy,
                           interpret=interpret, ir_op=ir_op, loc=loc)
