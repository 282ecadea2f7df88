"""The MLA mode crossover as `k3c inspect` prints it: for each MLA layer shape of a module, the fewest new tokens
for which MHA mode beats MQA mode after a given number of cached tokens on a target (the cost model is
k3c.analysis.cost.mla_mode_costs; the runtime's "auto" mode uses the same function per call)."""
from __future__ import annotations

from ..codegen.targets import Target
from ..ir.core import Module
from .cost import mla_crossover_new_tokens

CACHED_POINTS = (0, 4096, 32768, 131072)
_KEYS = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_crossover_lines(module: Module, target: Target, cached_points=CACHED_POINTS) -> list[str]:
    """IR comment lines, one per distinct MLA shape: 'MHA from N new tokens' at each cached length."""
    shapes = []
    for op in module.ops:
        if op.op in ("mla", "mla_absorbed"):
            key = tuple(op.attr(k) for k in _KEYS)
            if key not in shapes:
                shapes.append(key)
    lines = []
    for key in shapes:
        attrs = dict(zip(_KEYS, key))
        pts = []
        for c in cached_points:
            t = mla_crossover_new_tokens(attrs, c, target)
            pts.append(f"{c} cached: {'MQA always' if t is None else f'MHA from {t} new tokens'}")
        lines.append(f"# mla mode crossover on {target.name} (heads {key[0]}, latent {key[1]}+{key[3]}; "
                     f"cost model, per sequence): " + "; ".join(pts))
    return lines
