"""The `quantization:` section against the weights it names: what the `mxfp4` pass will pack, checked at load time
so a bad pattern is a spec error with file, line and field, not a failure deep in a pass.

Rules: every explicit pattern matches some weight; the selection is non-empty and holds only weights that a GEMM reads
as a plain operand (the ones the runtime reads packed: routed expert stacks, an untied lm_head, the dense MLP, the
MoE layer's shared experts and latent projections: QUANTIZABLE); each selected weight's reduction (last)
dimension is a multiple of 32;
and `precision.weights`, when given, declares the same weights and scale rule as MXFP4 (the cost model and the HF
export read the precision plan, so the two may not disagree). Without `precision.weights` it is derived from here.
"""
from __future__ import annotations

import re
from fnmatch import fnmatchcase

from .spec import ModelSpec, PrecisionSpec, WeightPrecisionSpec

BLOCK = 32   # MXFP4 block along the reduction dimension (k3c.quant.BLOCK_SIZE; not imported: no torch here)


# Non-expert weights k3c can read MXFP4: plain GEMM operands (mxfp4 pass -> lm_head / mlp / moe_linear with
# weight_format mxfp4). Groups quantize together (one weight_format per op): a layer's gate/up/down of an MLP.
_DENSE = (
    (re.compile(r"^lm_head\.weight$"), "lm_head", None),
    (re.compile(r"^(layers\.\d+\.mlp\.)(gate|up|down)_proj\.weight$"), "dense MLP", ("gate", "up", "down")),
    (re.compile(r"^(layers\.\d+\.block_sparse_moe\.shared_experts\.)(gate|up|down)_proj\.weight$"),
     "shared experts", ("gate", "up", "down")),
    (re.compile(r"^layers\.\d+\.block_sparse_moe\.routed_expert_(down|up)_proj\.weight$"), "latent projection",
     None),
)
QUANTIZABLE = ("routed expert stacks (experts.w1 / w3 / w2), lm_head.weight (untied), the dense MLP "
               "(mlp.gate_proj / up_proj / down_proj), the MoE layer's shared experts (shared_experts.*_proj) and "
               "latent projections (routed_expert_down_proj / routed_expert_up_proj)")


def _why_not(info) -> str:
    """Why a weight outside QUANTIZABLE stays float."""
    n = info.name
    if ".self_attn." in n:
        return "attention weights are consumed inside the fused KDA / MLA kernels, which read float weights"
    if n.endswith(".gate.weight"):
        return "the router GEMM stays float (fp32 logits), as K3 ships it"
    if n == "embed_tokens.weight":
        return "the embedding table is gathered, not a GEMM operand (a tied lm_head reads it too)"
    return f"a {info.kind} weight is not a GEMM operand"


def dense_group(name: str) -> tuple[str, list[str]] | None:
    """(what, the weights quantized with it) of a non-expert quantizable weight; None if it is not one."""
    for rx, what, group in _DENSE:
        m = rx.match(name)
        if m:
            return what, ([f"{m.group(1)}{g}_proj.weight" for g in group] if group else [name])
    return None


def select(names, include, exclude) -> list[str]:
    """Names matched by some include pattern and no exclude pattern (fnmatch, case-sensitive), in order."""
    return [n for n in names if any(fnmatchcase(n, p) for p in include)
            and not any(fnmatchcase(n, p) for p in exclude)]


def quantized_names(spec: ModelSpec) -> list[str]:
    """Canonical weights the spec's `quantization:` section selects ([] without one)."""
    from .weight_names import model_weights

    q = spec.quantization
    if q is None:
        return []
    return select([w.name for w in model_weights(spec)], q.include, q.exclude)


def check_quantization(spec: ModelSpec, sec, precision_sec) -> ModelSpec:
    """Validate spec.quantization (read from Section `sec`); returns the spec with the precision plan filled in."""
    from .weight_names import model_weights

    q = spec.quantization
    infos = {w.name: w for w in model_weights(spec)}
    names = list(infos)
    for key in ("include", "exclude"):
        if not sec.has(key):
            continue
        for i, pat in enumerate(getattr(q, key)):
            if not any(fnmatchcase(n, pat) for n in names):
                raise sec.error(key, f"pattern '{pat}' matches no weight of spec '{spec.name}' (patterns are "
                                     f"canonical names, e.g. 'layers.*.block_sparse_moe.experts.w1')",
                                sec.item_line(key, i))
    chosen = select(names, q.include, q.exclude)
    if not chosen:
        where = next((k for k in ("exclude", "include") if sec.has(k)), "format")
        raise sec.error(where, "selects no weight to quantize" + (
            "" if spec.mlp.moe is not None or sec.has("include") else
            " (the default selects routed experts and the spec has none: list linears under include, e.g. "
            "'lm_head.weight', or drop the section)"))
    for n in chosen:
        if infos[n].kind == "experts":
            what, stacks = "routed experts", [n.rpartition(".")[0] + "." + w for w in ("w1", "w3", "w2")]
            rule = "a layer's expert stacks w1, w3 and w2 are quantized together (one expert format per MoE layer)"
        else:
            group = dense_group(n) if infos[n].kind == "linear" else None
            if group is None:
                i, pat = next((i, p) for i, p in enumerate(q.include) if fnmatchcase(n, p))
                raise sec.error("include", f"pattern '{pat}' selects '{n}', which k3c cannot quantize: "
                                           f"{_why_not(infos[n])}. MXFP4 applies to {QUANTIZABLE}; exclude it",
                                sec.item_line("include", i) if sec.has("include") else None)
            what, stacks = group
            rule = f"the {what}'s gate_proj, up_proj and down_proj are quantized together (one MXFP4 GEMM format " \
                   f"per op)"
        if not all(x in chosen for x in stacks):
            missing = next(x for x in stacks if x not in chosen)
            raise sec.error("exclude" if sec.has("exclude") else "include",
                            f"selects '{n}' but not '{missing}': {rule}")
        k = infos[n].shape[-1]
        if k % BLOCK:
            raise sec.error("format", f"weight '{n}' {list(infos[n].shape)} has reduction dimension {k}, not a "
                                      f"multiple of the MXFP4 block {BLOCK}")
    return spec.replace(precision=_precision_plan(spec, chosen, precision_sec, sec))


def _precision_plan(spec: ModelSpec, chosen: list[str], precision_sec, sec) -> PrecisionSpec:
    from .hf_config import quantization_patterns, quantized_weight_names

    q = spec.quantization
    given = precision_sec is not None and precision_sec.has("weights")
    if not given:
        include, exclude = quantization_patterns(spec, set(chosen))
        weights = WeightPrecisionSpec(format="mxfp4", include=tuple(include), exclude=tuple(exclude),
                                      scale_rule=q.rule)
        return PrecisionSpec(weights=weights, activations=spec.precision.activations)
    w = spec.precision.weights
    declared = quantized_weight_names(spec)
    if w.format != "mxfp4" or declared != set(chosen):
        extra = sorted(set(chosen) - declared) or sorted(declared - set(chosen))
        raise sec.error(None, f"disagrees with precision.weights (format {w.format}): "
                              f"'{extra[0]}' is MXFP4 in one and not the other; make them select the same weights "
                              f"(or drop precision.weights: it follows this section)")
    if w.scale_rule != q.rule:
        raise sec.error("rule", f"rule {q.rule} disagrees with precision.weights.scale_rule {w.scale_rule}")
    return spec.precision
