"""Which weights are MXFP4: the rules over canonical weight names that the `quantization:` section, the precision
plan and the HF quantization_config all follow.

The `quantization:` section is checked against the weights it names at load time (check_quantization), so a bad
pattern is a spec error with file, line and field, not a failure deep in a pass. Rules: every explicit pattern
matches some weight; the selection is non-empty and holds only weights that a GEMM reads as a plain operand (the ones
the runtime reads packed: routed expert stacks, an untied lm_head, the dense MLP, the MoE layer's shared experts and
latent projections: QUANTIZABLE), each with the rest of its group (a layer's three expert stacks; an MLP's gate, up
and down); each selected weight's reduction (last) dimension is a multiple of 32; and `precision.weights`, when
given, declares the same weights and scale rule as MXFP4 (the cost model and the HF export read the precision plan,
so the two may not disagree). Without `precision.weights` it is derived from here, in the canonical pattern form of
quantization_patterns.
"""
from __future__ import annotations

import re
from fnmatch import fnmatchcase

from .spec import DEFAULT_MXFP4_INCLUDE, ModelSpec, PrecisionSpec, WeightPrecisionSpec
from .weight_names import WeightInfo, model_weights, weight_table

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
    q = spec.quantization
    if q is None:
        return []
    return select([w.name for w in model_weights(spec)], q.include, q.exclude)


def _group(info: WeightInfo) -> tuple[list[str], str] | None:
    """(the weights quantized together with `info`, the rule that says so); None if k3c cannot quantize it."""
    if info.kind == "experts":
        prefix = info.name.rpartition(".")[0]
        return ([f"{prefix}.{w}" for w in ("w1", "w3", "w2")],
                "a layer's expert stacks w1, w3 and w2 are quantized together (one expert format per MoE layer)")
    group = dense_group(info.name) if info.kind == "linear" else None
    if group is None:
        return None
    what, stacks = group
    return stacks, f"the {what}'s gate_proj, up_proj and down_proj are quantized together (one MXFP4 GEMM format " \
                   f"per op)"


def packable(spec: ModelSpec, chosen: set[str]) -> bool:
    """Whether a `quantization:` section may select exactly `chosen` (the grouping rules of check_quantization)."""
    infos = weight_table(spec)
    for n in chosen:
        group = _group(infos[n])
        if group is None or not set(group[0]) <= chosen:
            return False
    return True


def check_quantization(spec: ModelSpec, sec, precision_sec) -> ModelSpec:
    """Validate spec.quantization (read from Section `sec`); returns the spec with the precision plan filled in."""
    q = spec.quantization
    infos = weight_table(spec)
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
        group = _group(infos[n])
        if group is None:
            i, pat = next((i, p) for i, p in enumerate(q.include) if fnmatchcase(n, p))
            raise sec.error("include", f"pattern '{pat}' selects '{n}', which k3c cannot quantize: "
                                       f"{_why_not(infos[n])}. MXFP4 applies to {QUANTIZABLE}; exclude it",
                            sec.item_line("include", i) if sec.has("include") else None)
        stacks, rule = group
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


# ---------------------------------------------------------------------------------------------------------------
# the precision plan's MXFP4 weights, as names and as canonical patterns
def quantizable_names(spec: ModelSpec) -> list[str]:
    """The Linear weights and routed expert stacks: what precision patterns range over."""
    return [w.name for w in model_weights(spec) if w.kind in ("linear", "experts")]


def expert_stack_names(spec: ModelSpec) -> set[str]:
    """The routed expert stacks (experts.w1 / w3 / w2 of every MoE layer): what DEFAULT_MXFP4_INCLUDE selects."""
    return {w.name for w in model_weights(spec) if w.kind == "experts"}


def quantized_weight_names(spec: ModelSpec) -> set[str]:
    """Canonical Linear/expert weights that the spec's precision patterns select for MXFP4."""
    w = spec.precision.weights
    if w.format != "mxfp4":
        return set()
    return set(select(quantizable_names(spec), w.include, w.exclude))


_EXPERT_FAMILY = re.compile(r"^layers\.\*\.block_sparse_moe\.experts\.w[123]$")


def weight_families(names: list[str]) -> dict[str, list[str]]:
    """Names grouped by their pattern over all layers (`layers.3.mlp.up_proj.weight` -> `layers.*.mlp.up_proj.weight`),
    in order."""
    families: dict[str, list[str]] = {}
    for n in names:
        families.setdefault(re.sub(r"^layers\.\d+\.", "layers.*.", n), []).append(n)
    return families


def quantization_patterns(spec: ModelSpec, quantized: set[str]) -> tuple[list[str], list[str]]:
    """Canonical (include, exclude) fnmatch patterns that select exactly `quantized` among the Linear weights."""
    if quantized == expert_stack_names(spec):
        return list(DEFAULT_MXFP4_INCLUDE), []
    names = quantizable_names(spec)
    include: list[str] = []
    exclude: list[str] = []
    for fam, members in weight_families(names).items():
        q = [n for n in members if n in quantized]
        if not q:
            continue
        if len(q) == len(members):
            include.append(fam)
        elif 2 * len(q) >= len(members):
            include.append(fam)
            exclude += [n for n in members if n not in quantized]
        else:
            include += q
    # three complete expert families -> the one default pattern
    full_experts = [p for p in include if _EXPERT_FAMILY.match(p)]
    if len(full_experts) == 3:
        include = [p for p in include if p not in full_experts] + list(DEFAULT_MXFP4_INCLUDE)
    # a layer whose three expert tensors are all excluded -> one pattern
    by_layer: dict[str, list[str]] = {}
    for n in exclude:
        m = re.match(r"^(layers\.\d+\.block_sparse_moe\.experts)\.w[123]$", n)
        if m:
            by_layer.setdefault(m.group(1), []).append(n)
    for prefix, items in by_layer.items():
        if len(items) == 3:
            exclude = [n for n in exclude if n not in items] + [prefix + ".*"]
    if set(select(names, include, exclude)) != quantized:     # never expected; stay exact regardless
        return sorted(quantized), []
    return include, exclude
