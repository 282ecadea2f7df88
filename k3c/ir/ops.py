"""The op registry: per op name, its input roles, attributes and type-inference rule.

An `OpDef` says what an op means to the verifier and to passes:
  * `roles(attrs)` -> the input roles in order. Param roles of layer ops are canonical weight-name suffixes
    (k3c/frontend/weight_names.py), so the verifier can check that `q_proj.weight` really feeds the q_proj slot.
  * `attrs`: name -> AttrSpec (type, required, choices). Every op may also carry COMMON_ATTRS.
  * `infer(attrs, ins)` -> result types from the input types (a dict role -> TensorType), raising TypeCheck
    on inconsistent inputs; None for ops whose type is declared (input, param).
Later passes add kernel-level ops with `register_op(OpDef(...))`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import IRError
from .core import FLOAT_DTYPES, INT_DTYPES, Op, TensorType


class TypeCheck(Exception):
    """An inconsistency found by an inference rule; the verifier turns it into an IRError naming the op."""


@dataclass(frozen=True)
class Role:
    name: str
    param: bool = False      # a weight slot: when fed by a `param` op its name must end with this suffix


@dataclass(frozen=True)
class AttrSpec:
    kind: str                              # int | float | str | bool | ints | floats | strs
    required: bool = True
    nullable: bool = False                 # None allowed (e.g. mla q_lora_rank)
    choices: tuple | None = None
    doc: str = ""

    def check(self, value: Any) -> str | None:
        """None if `value` fits, else a description of what was expected."""
        if value is None:
            return None if self.nullable else f"{self.kind}, got none"
        ok = _KIND_CHECK[self.kind](value)
        if not ok:
            return f"{self.kind}{' or none' if self.nullable else ''}, got {type(value).__name__} {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"one of {', '.join(map(repr, self.choices))}, got {value!r}"
        return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KIND_CHECK: dict[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "float": lambda v: isinstance(v, float),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "ints": lambda v: isinstance(v, tuple) and all(_is_int(x) for x in v),
    "floats": lambda v: isinstance(v, tuple) and all(isinstance(x, float) for x in v),
    "strs": lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v),
}

# Attributes any op may carry: the 0-based decoder layer it belongs to, and a sharding annotation for the
# future `shard` pass (e.g. "tp:heads", "ep:experts").
COMMON_ATTRS: dict[str, AttrSpec] = {
    "layer": AttrSpec("int", required=False, doc="0-based decoder layer"),
    "shard": AttrSpec("str", required=False, doc="sharding annotation"),
    # set by the `codegen` pass on every compute op: how the runtime executes it
    "impl": AttrSpec("str", required=False, choices=("kernel", "extern", "extern:reference"),
                     doc="kernel: a generated Triton kernel; extern: torch / vendor BLAS; "
                         "extern:reference: the eager reference until a kernel issue lowers the op"),
}

InferFn = Callable[[Mapping[str, Any], Mapping[str, TensorType]], Sequence[TensorType]]
CheckFn = Callable[[Mapping[str, Any]], None]


@dataclass(frozen=True)
class OpDef:
    name: str
    roles: Callable[[Mapping[str, Any]], tuple[Role, ...]]
    attrs: Mapping[str, AttrSpec] = field(default_factory=dict)
    infer: InferFn | None = None           # None: the op's declared type is authoritative (input, param)
    check: CheckFn | None = None           # attr-only rules beyond AttrSpec (conditional attrs, ranges)
    num_results: int = 1
    pure: bool = True                      # CSE may merge two identical ops
    keep: bool = False                     # never dead (model inputs): DCE keeps it, the verifier allows it unused
    doc: str = ""

    def all_attrs(self) -> dict[str, AttrSpec]:
        out = dict(COMMON_ATTRS)
        out.update(self.attrs)
        return out


_REGISTRY: dict[str, OpDef] = {}


def register_op(opdef: OpDef, *, replace: bool = False) -> OpDef:
    if opdef.name in _REGISTRY and not replace:
        raise IRError(f"op '{opdef.name}' is already registered")
    _REGISTRY[opdef.name] = opdef
    return opdef


def get_op_def(name: str) -> OpDef | None:
    return _REGISTRY.get(name)


def registered_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def bind(op: Op) -> dict[str, str]:
    """Role name -> input value name of `op` (its OpDef's roles for its attrs, in input order): the one place an
    op's inputs are matched to what they mean."""
    return bind_inputs(op.op, op.attr_dict, op.inputs)


def bind_inputs(op_name: str, attrs: Mapping[str, Any], inputs: Sequence[str]) -> dict[str, str]:
    """bind() for inputs of an op not built yet (a pass about to rewrite it)."""
    opdef = get_op_def(op_name)
    if opdef is None:
        raise IRError(f"unknown op '{op_name}'")
    return {r.name: v for r, v in zip(opdef.roles(attrs), inputs)}


# ---- helpers for inference rules -------------------------------------------------------------------------
def fixed_roles(*names: str, params: Sequence[str] = ()) -> Callable[[Mapping[str, Any]], tuple[Role, ...]]:
    roles = tuple(Role(n) for n in names) + tuple(Role(p, param=True) for p in params)
    return lambda attrs: roles


def expect(t: TensorType, role: str, shape: Sequence[Any], dtypes: frozenset | None = None) -> None:
    """`t` must have exactly `shape` (None entries match anything) and, if given, a dtype in `dtypes`."""
    if len(t.shape) != len(shape) or any(e is not None and e != d for e, d in zip(shape, t.shape)):
        want = ", ".join("?" if e is None else str(e) for e in shape)
        raise TypeCheck(f"{role}: expected shape [{want}], got {t}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeCheck(f"{role}: expected dtype in {{{', '.join(sorted(dtypes))}}}, got {t}")


def activation(ins: Mapping[str, TensorType], role: str = "x") -> tuple[TensorType, Any]:
    """A hidden-state input [..., D] of a float dtype; returns (type, D)."""
    t = ins[role]
    if t.rank < 1:
        raise TypeCheck(f"{role}: expected a tensor [..., hidden], got {t}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeCheck(f"{role}: expected a float dtype, got {t}")
    return t, t.shape[-1]


def same_type(ins: Mapping[str, TensorType], roles: Sequence[str]) -> TensorType:
    first = ins[roles[0]]
    for r in roles[1:]:
        if ins[r] != first:
            raise TypeCheck(f"{r}: expected {first} (as {roles[0]}), got {ins[r]}")
    return first


def require(cond: bool, message: str) -> None:
    if not cond:
        raise TypeCheck(message)


# ---- model interface and generic ops ---------------------------------------------------------------------
NAME_ATTR = {"name": AttrSpec("str", doc="model input / canonical weight name")}

register_op(OpDef("input", fixed_roles(), NAME_ATTR, keep=True, pure=False,
                  doc="a model input (e.g. token ids i64[B, T]); its type is declared"))
# a weight a pass derived from another one (the `mxfp4` pass: `P.weight_packed` / `P.weight_scale` from `P`)
PARAM_ATTRS = {**NAME_ATTR,
               "quant": AttrSpec("str", required=False, choices=("mxfp4",), doc="quantized form of `source`"),
               "rule": AttrSpec("str", required=False, choices=("floor", "rceil"), doc="MX scale rule"),
               "source": AttrSpec("str", required=False, doc="the canonical weight it is derived from")}
register_op(OpDef("param", fixed_roles(), PARAM_ATTRS,
                  doc="a weight, named by its canonical weight name; its type is declared, no data in the IR"))


def _infer_add(attrs, ins):
    return (same_type(ins, ("lhs", "rhs")),)


register_op(OpDef("add", fixed_roles("lhs", "rhs"), {}, _infer_add, doc="elementwise sum of two same-typed tensors"))


def _infer_rmsnorm(attrs, ins):
    x, d = activation(ins)
    expect(ins["weight"], "weight", (d,))
    return (x,)


register_op(OpDef("rmsnorm", fixed_roles("x", params=("weight",)), {"eps": AttrSpec("float")}, _infer_rmsnorm,
                  doc="x / sqrt(mean(x^2) + eps) * weight over the last dim"))


def _infer_embedding(attrs, ins):
    ids, w = ins["ids"], ins["embed_tokens.weight"]
    require(ids.dtype in INT_DTYPES, f"ids: expected an integer dtype, got {ids}")
    require(w.rank == 2, f"embed_tokens.weight: expected [vocab, hidden], got {w}")
    return (TensorType(w.dtype, ids.shape + (w.shape[1],)),)


register_op(OpDef("embedding", fixed_roles("ids", params=("embed_tokens.weight",)), {}, _infer_embedding,
                  doc="row gather: ids [...] -> [..., hidden]"))


# ---- MXFP4 dense linears (the `mxfp4` pass) ------------------------------------------------------------------
PACKED_PARTS = ("weight_packed", "weight_scale")
WEIGHT_FORMATS = ("bf16", "mxfp4")
MX_ATTRS = {      # on the ops whose plain GEMM weights the `mxfp4` pass may pack (lm_head, mlp, moe_linear)
    "weight_format": AttrSpec("str", required=False, choices=WEIGHT_FORMATS,
                              doc="the op's linear weights: float (absent = bf16) or MXFP4 packed + E8M0 scales"),
    "act_format": AttrSpec("str", required=False, choices=("bf16", "mxfp8", "mxfp4"),
                           doc="mxfp4 weights: the spec's activation format (native tl.dot_scaled where the target "
                               "has MX matrix units and activations are MX; upcast in registers elsewhere)"),
}


def packed_name(name: str, part: str) -> str:
    """The packed tensor of a weight (or role) quantized to MXFP4, `part` weight_packed | weight_scale:
    `lm_head.weight` -> `lm_head.weight_packed` (compressed-tensors' naming of a Linear), role `weight` ->
    `weight_packed`, an expert stack `...experts.w1` -> `...experts.w1.weight_packed`."""
    if name == "weight" or name.endswith(".weight"):
        return name[: -len("weight")] + part
    return f"{name}.{part}"


def packed_roles(role: str) -> tuple[Role, Role]:
    return tuple(Role(packed_name(role, part), param=True) for part in PACKED_PARTS)


def is_mxfp4(attrs: Mapping[str, Any]) -> bool:
    return attrs.get("weight_format", "bf16") == "mxfp4"


def linear_weight(ins: Mapping[str, TensorType], role: str, packed: bool) -> TensorType:
    """The logical [out, in] type of a linear weight role: the float tensor itself, or (packed) the float-typed view
    of its MXFP4 pair, u8 payload [out, in/2] + u8 E8M0 scales [out, in/32], checked against each other."""
    if not packed:
        return ins[role]
    u8 = frozenset({"u8"})
    p, s = (packed_name(role, part) for part in PACKED_PARTS)
    tp, ts = ins[p], ins[s]
    expect(tp, p, (None, None), u8)
    rows, half = tp.shape
    k = half * 2 if isinstance(half, int) else None
    expect(ts, s, (rows, k // 32 if isinstance(k, int) else None), u8)
    return TensorType("bf16", (rows, k))


def _lm_head_roles(attrs):
    if attrs.get("tied"):
        return (Role("x"), Role("embed_tokens.weight", param=True))
    if is_mxfp4(attrs):
        return (Role("x"),) + packed_roles("lm_head.weight")
    return (Role("x"), Role("lm_head.weight", param=True))


def _check_lm_head(attrs):
    if attrs.get("tied") and is_mxfp4(attrs):
        raise TypeCheck("a tied lm_head reads the embedding table, which stays float (weight_format mxfp4 needs an "
                        "untied lm_head.weight)")


def _infer_lm_head(attrs, ins):
    x, d = activation(ins)
    role = "embed_tokens.weight" if attrs.get("tied") else "lm_head.weight"
    w = linear_weight(ins, role, is_mxfp4(attrs))
    require(w.rank == 2, f"{role}: expected [vocab, hidden], got {w}")
    expect(w, role, (None, d))
    return (TensorType(x.dtype, x.shape[:-1] + (w.shape[0],)),)


register_op(OpDef("lm_head", _lm_head_roles, {"tied": AttrSpec("bool", doc="weight shared with embed_tokens"),
                                              **MX_ATTRS},
                  _infer_lm_head, _check_lm_head, doc="logits = x @ W^T, [..., hidden] -> [..., vocab]"))

from . import layer_ops  # noqa: E402,F401  (registers kda, mla, mlp, moe, attn_res_mix)


def _register_kernel_level_ops() -> None:
    """Kernel-level ops that the lowering passes introduce live in k3c/ir/*_ops.py (one file per family);
    importing them here registers them without editing a central list."""
    import importlib
    import pkgutil

    from .. import ir as _pkg

    for info in sorted(pkgutil.iter_modules(_pkg.__path__), key=lambda m: m.name):
        if info.name.endswith("_ops") and info.name != "layer_ops":
            importlib.import_module(f"{_pkg.__name__}.{info.name}")


_register_kernel_level_ops()
