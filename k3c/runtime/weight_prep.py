"""Weights for a compiled graph: what the lowered IR's `param` ops need, checked and prepared once at load.

The IR decides which tensors a graph reads (passes change them: `mxfp4` turns a bf16 expert stack into packed
payload + scales, `shard` into one rank's slice), so weights are checked against the IR's params, never re-derived
from the spec. `prepare_weights` is the one place where load-time preparation happens; a failure names the weight
and what the graph expected, and nothing is moved to the device before every check passed.
"""
from __future__ import annotations

import torch

from ..errors import WeightError
from ..ir import Module
from ..ir.mxfp4_weights import packed_name

_FLOAT_DTYPES = ("f32", "bf16", "f16", "f64")


def expert_layout(target) -> str:
    """The load-time layout of routed MXFP4 expert stacks on `target` (Target.expert_layout): "hopper" on sm_90
    targets, else "canonical" (k3c.quant's layout, which the native-MX targets read as it is)."""
    return getattr(target, "expert_layout", "canonical") if target is not None else "canonical"


def graph_params(module: Module) -> dict[str, object]:
    """name -> TensorType of every weight the graph reads."""
    return {op.attr("name"): op.types[0] for op in module.ops if op.op == "param"}


def prepare_weights(module: Module, weights: dict[str, torch.Tensor], spec=None) -> dict[str, torch.Tensor]:
    """The subset of `weights` the graph reads, after load-time preparation, each checked against its param type.
    Raises WeightError for a missing weight or a wrong shape or dtype.

    MXFP4 (params with attr quant="mxfp4", named `P.weight_packed` / `P.weight_scale` (`lm_head.weight_packed` for
    a linear `lm_head.weight`: k3c.ir.mxfp4_weights.packed_name), source P): packed tensors
    given under those names (a packed checkpoint) are used as they are; otherwise a float `P` is quantized here, once,
    with the param's scale rule. The other way round, a graph reading a float `P` given only packed tensors (a K3
    checkpoint compiled without quantization) gets it dequantized.

    Routed MXFP4 expert stacks whose grouped GEMMs carry expert_layout "hopper" (sm_90 targets: moe-lower) are then
    rewritten into that layout (_to_expert_layouts); checkpoints hold k3c.quant's layout either way."""
    out: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}     # source -> (packed, scales) made here
    params = {op.attr("name"): op for op in module.ops if op.op == "param"}
    for name, op in params.items():
        ty = op.types[0]
        t = weights.get(name)
        if t is None and op.attr("quant", None) == "mxfp4":
            t = _quantized_part(name, op, weights, quantized)
        elif t is None and packed_name(name, "weight_packed") in weights:
            t = _dequantized(name, weights)
        if t is None:
            raise WeightError(f"weight '{name}' is missing" + (f" for spec '{spec.name}'" if spec is not None else ""))
        want = tuple(ty.shape)
        if all(isinstance(d, int) for d in want) and tuple(t.shape) != want:
            raise WeightError(f"weight '{name}' has shape {tuple(t.shape)}, the graph needs {want}")
        if ty.dtype == "u8" and t.dtype != torch.uint8:
            raise WeightError(f"weight '{name}' has dtype {t.dtype}, the graph needs uint8 (MXFP4 "
                              f"{'payload' if name.endswith('.weight_packed') else 'E8M0 scales'})")
        if t.is_floating_point() != (ty.dtype in _FLOAT_DTYPES):       # float weights may be bf16 or f32
            raise WeightError(f"weight '{name}' has dtype {t.dtype}, the graph needs {ty.dtype}")
        out[name] = t
    _to_expert_layouts(module, out)
    return out


HOPPER_OPS = ("moe_gate_up", "moe_down")     # the ops whose expert_layout attr says how their stacks are laid out
_LAYOUT_MARK = "_k3c_expert_layout"          # set on a stack rewritten here: preparing prepared weights again is a no-op


def _to_expert_layouts(module: Module, out: dict[str, torch.Tensor]) -> None:
    """The MXFP4 expert stacks of ops with expert_layout "hopper" (moe-lower, the target's choice) rewritten into the
    hopper layout (k3c.codegen.kernels.moe_hopper): new tensors (the caller's, e.g. a checkpoint's, stay as they
    are), each marked so that preparing these weights again leaves them alone."""
    from .expert_layout import to_hopper, to_hopper_scales

    from ..ir.ops import bind

    defs = None
    for op in module.ops:
        if op.op not in HOPPER_OPS or op.attr("expert_layout", "canonical") != "hopper":
            continue
        defs = defs if defs is not None else module.defs
        for role, v in bind(op).items():
            src = defs.get(v)
            if not role.startswith("experts.") or src is None or src.op != "param":
                continue
            name = src.attr("name")
            t = out[name]
            if in_hopper_layout(t):
                continue
            try:
                if t.is_meta:           # no data to move (recordings of the launches on meta tensors)
                    t = torch.empty_like(t)
                else:
                    t = to_hopper(t) if role.endswith("weight_packed") else to_hopper_scales(t)
            except ValueError as exc:
                raise WeightError(f"weight '{name}': {exc}") from None
            setattr(t, _LAYOUT_MARK, "hopper")
            out[name] = t


def in_hopper_layout(t: torch.Tensor) -> bool:
    """Whether prepare_weights rewrote `t` into the hopper layout (the mark does not survive .to() / copies)."""
    return getattr(t, _LAYOUT_MARK, None) == "hopper"


def _quantized_part(name: str, op, weights: dict, made: dict) -> torch.Tensor | None:
    """`P.weight_packed` or `P.weight_scale` made from the float weight P (once for both parts)."""
    source, rule = op.attr("source"), op.attr("rule", "floor")
    sibling = packed_name(source, "weight_scale" if name.endswith("weight_packed") else "weight_packed")
    if sibling in weights:
        raise WeightError(f"weight '{name}' is missing while '{sibling}' is given (a packed checkpoint holds both)")
    if source not in made:
        w = weights.get(source)
        if w is None:
            return None
        if not w.is_floating_point():
            raise WeightError(f"weight '{source}' has dtype {w.dtype}; MXFP4 quantization needs a float tensor")
        made[source] = quantize_stack(source, w, rule)
    packed, scales = made[source]
    return packed if name.endswith("weight_packed") else scales


def quantize_stack(name: str, w: torch.Tensor, rule: str, chunk_bytes: int = 1 << 28
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp4_quantize along the last dim, a slab of leading rows at a time (bounded temporaries for K3 stacks)."""
    from ..quant import BLOCK_SIZE, mxfp4_quantize

    if w.dim() == 0 or w.shape[-1] % BLOCK_SIZE:
        raise WeightError(f"weight '{name}' {tuple(w.shape)}: its last (reduction) dimension must be a multiple of "
                          f"{BLOCK_SIZE} for MXFP4")
    flat = w.reshape(-1, w.shape[-1])
    rows = max(1, chunk_bytes // max(1, w.shape[-1] * 16))
    parts = [mxfp4_quantize(flat[i:i + rows], rule) for i in range(0, flat.shape[0], rows)]
    packed = torch.cat([p for p, _ in parts]).reshape(*w.shape[:-1], -1)
    scales = torch.cat([s for _, s in parts]).reshape(*w.shape[:-1], -1)
    return packed, scales


def _dequantized(name: str, weights: dict) -> torch.Tensor:
    from ..quant import mxfp4_dequantize

    pn, sn = packed_name(name, "weight_packed"), packed_name(name, "weight_scale")
    packed, scales = weights[pn], weights.get(sn)
    if scales is None:
        raise WeightError(f"weight '{pn}' is given without '{sn}'")
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise WeightError(f"weights '{pn}' / '{sn}' must be uint8, got {packed.dtype} and {scales.dtype}")
    ref = weights.get("embed_tokens.weight")
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.bfloat16
    try:
        return mxfp4_dequantize(packed, scales, dtype)
    except ValueError as exc:
        raise WeightError(f"weight '{name}': {exc}") from None
