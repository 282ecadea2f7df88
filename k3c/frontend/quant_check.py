"""The `quantization:` section against the weights it names: what the `mxfp4` pass will pack, checked at load time
so a bad pattern is a spec error with file, line and field, not a failure deep in a pass.

Rules: every explicit pattern matches some weight; the selection is non-empty and holds routed expert stacks only
(the only weights the runtime reads packed); each selected weight's reduction (last) dimension is a multiple of 32;
and `precision.weights`, when given, declares the same weights and scale rule as MXFP4 (the cost model and the HF
export read the precision plan, so the two may not disagree). Without `precision.weights` it is derived from here.
"""
from __future__ import annotations

from fnmatch import fnmatchcase

from .spec import ModelSpec, PrecisionSpec, WeightPrecisionSpec

BLOCK = 32   # MXFP4 block along the reduction dimension (k3c.quant.BLOCK_SIZE; not imported: no torch here)


def select(names, include, exclude) -> list[str]:
    """Names matched by some include pattern and no exclude pattern (fnmatch, case-sensitive), in order."""
    return [n for n in names if any(fnmatchcase(n, p) for p in include)
            and not any(fnmatchcase(n, p) for p in exclude)]


def quantized_names(spec: ModelSpec) -> list[str]:
    """Canonical weights the spec's `quantization:` section selects ([] without one)."""
    from ..runtime.weight_names import model_weights

    q = spec.quantization
    if q is None:
        return []
    return select([w.name for w in model_weights(spec)], q.include, q.exclude)


def check_quantization(spec: ModelSpec, sec, precision_sec) -> ModelSpec:
    """Validate spec.quantization (read from Section `sec`); returns the spec with the precision plan filled in."""
    from ..runtime.weight_names import model_weights

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
            "" if spec.mlp.moe is not None else " (the spec has no routed experts: drop the section)"))
    for n in chosen:
        if infos[n].kind != "experts":
            i, pat = next((i, p) for i, p in enumerate(q.include) if fnmatchcase(n, p))
            raise sec.error("include", f"pattern '{pat}' selects '{n}': k3c quantizes routed expert stacks only "
                                       f"(experts.w1 / w3 / w2); exclude it", sec.item_line("include", i)
                            if sec.has("include") else None)
        stacks = [n.rpartition(".")[0] + "." + w for w in ("w1", "w3", "w2")]
        if not all(x in chosen for x in stacks):
            missing = next(x for x in stacks if x not in chosen)
            raise sec.error("exclude" if sec.has("exclude") else "include",
                            f"selects '{n}' but not '{missing}': a layer's expert stacks w1, w3 and w2 are quantized "
                            f"together (one expert format per MoE layer)")
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
