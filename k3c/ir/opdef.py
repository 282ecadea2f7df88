"""What an op definition is made of: `OpDef`, its input `Role`s and `AttrSpec`s, and the helpers inference rules
share. The op families (k3c/ir/*_ops.py) build their OpDefs from these; k3c/ir/ops.py composes the registry.

An `OpDef` says what an op means to the verifier and to passes:
  * `roles(attrs)` -> the input roles in order. Param roles of layer ops are canonical weight-name suffixes
    (k3c/frontend/weight_names.py), so the verifier can check that `q_proj.weight` really feeds the q_proj slot.
  * `attrs`: name -> AttrSpec (type, required, choices). Every op may also carry COMMON_ATTRS.
  * `infer(attrs, ins)` -> result types from the input types (a dict role -> TensorType), raising TypeCheck
    on inconsistent inputs; None for ops whose type is declared (input, param).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .core import FLOAT_DTYPES, TensorType


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

# Attributes any op may carry: the 0-based decoder layer it belongs to, and the sharding annotation of the
# `shard` pass (e.g. "tp:heads", "ep:experts").
COMMON_ATTRS: dict[str, AttrSpec] = {
    "layer": AttrSpec("int", required=False, doc="0-based decoder layer"),
    "shard": AttrSpec("str", required=False, doc="sharding annotation"),
    # set by the `codegen` pass on every compute op: how the runtime executes it
    "impl": AttrSpec("str", required=False, choices=("kernel", "extern", "extern:reference"),
                     doc="kernel: a generated Triton kernel; extern: torch / vendor BLAS; "
                         "extern:reference: the eager reference where no lowering to kernels exists"),
}

RolesFn = Callable[[Mapping[str, Any]], tuple[Role, ...]]
InferFn = Callable[[Mapping[str, Any], Mapping[str, TensorType]], Sequence[TensorType]]
CheckFn = Callable[[Mapping[str, Any]], None]


@dataclass(frozen=True)
class OpDef:
    name: str
    roles: RolesFn
    attrs: Mapping[str, AttrSpec] = field(default_factory=dict)
    infer: InferFn | None = None           # None: the op's declared type is authoritative (input, param)
    check: CheckFn | None = None           # attr-only rules beyond AttrSpec (conditional attrs, ranges)
    num_results: int = 1
    pure: bool = True                      # CSE may merge two identical ops
    keep: bool = False                     # never dead (model inputs): DCE keeps it, the verifier allows it unused
    weight_transform: bool = False         # over weights only: evaluated once when weights load (impl "extern")
    sequence_state: bool = False           # reads and writes its layer's per-sequence cache entry (KDA state, MLA
    #                                        latents): a packed call of unequal segments runs it per group of equal
    #                                        lengths (runtime/caches/packed.py)
    doc: str = ""

    def all_attrs(self) -> dict[str, AttrSpec]:
        out = dict(COMMON_ATTRS)
        out.update(self.attrs)
        return out


# ---- helpers for role, check and inference rules ------------------------------------------------------------
def fixed_roles(*names: str, params: Sequence[str] = ()) -> RolesFn:
    roles = tuple(Role(n) for n in names) + tuple(Role(p, param=True) for p in params)
    return lambda attrs: roles


def check_positive(attrs: Mapping[str, Any], *names: str) -> None:
    """Each of the attrs `names` that is present is >= 1."""
    for n in names:
        v = attrs.get(n)
        if v is not None and v < 1:
            raise TypeCheck(f"attribute '{n}' must be >= 1, got {v}")


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
