"""IR node types: TensorType, Op, Module. Frozen, validated at construction, compared structurally.

Attribute values are int, float, str, bool, None or flat tuples of those. Equality is type-strict (True != 1,
1 != 1.0, -0.0 != 0.0, nan == nan) so that `parse(print(m)) == m` means the text really round-trips.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping, Union

from ..errors import IRError
from .printer import print_module, print_op

Scalar = Union[int, float, str, bool, None]
AttrValue = Union[Scalar, tuple]
Dim = Union[int, str]

# Value, op and symbol names. Dots let hand-written IR use readable names (%l0.q); nothing needs quoting.
VALUE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]*\Z")
OP_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
ATTR_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
DIM_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
DTYPE_RE = re.compile(r"[a-z][a-z0-9]*\Z")
MODULE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")

# Known element types (the verifier rejects others). Width in bits, for analyses.
DTYPE_BITS = {
    "f64": 64, "f32": 32, "bf16": 16, "f16": 16, "fp8e4m3": 8, "fp8e5m2": 8, "fp4e2m1": 4, "e8m0": 8,
    "i64": 64, "i32": 32, "i16": 16, "i8": 8, "u8": 8, "bool": 8,
}
FLOAT_DTYPES = frozenset({"f64", "f32", "bf16", "f16", "fp8e4m3", "fp8e5m2", "fp4e2m1"})
INT_DTYPES = frozenset({"i64", "i32", "i16", "i8", "u8"})
# How users, configs and checkpoints spell the float types a model runs in -> the IR's name for it.
DTYPE_SPELLINGS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "f16", "f16": "f16", "float16": "f16", "half": "f16",
                   "fp32": "f32", "f32": "f32", "float32": "f32", "float": "f32"}

_MISSING = object()


def _bad(message: str) -> IRError:
    return IRError(message)


def check_name(kind: str, name: Any, pattern: re.Pattern) -> None:
    if not isinstance(name, str) or not pattern.match(name):
        raise _bad(f"invalid {kind} {name!r}: must match {pattern.pattern[:-2]}")


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[Dim, ...] = ()

    def __post_init__(self):
        check_name("dtype", self.dtype, DTYPE_RE)
        if not isinstance(self.shape, tuple):
            object.__setattr__(self, "shape", tuple(self.shape))
        for d in self.shape:
            if isinstance(d, bool) or not (isinstance(d, int) and d >= 0 or isinstance(d, str) and DIM_RE.match(d)):
                raise _bad(f"invalid dimension {d!r} in {self.dtype} type: a non-negative int or a symbol")

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, shape: Iterable[Dim]) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(dtype, self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


# ---- attributes ------------------------------------------------------------------------------------------
def _check_scalar(key: str, v: Any) -> None:
    if v is None or isinstance(v, (bool, int, str)):
        return
    if isinstance(v, float):
        return
    raise _bad(f"attribute '{key}': unsupported value {v!r} ({type(v).__name__}); "
               "use int, float, str, bool, None or a flat tuple of those")


def normalize_attr(key: str, v: Any) -> AttrValue:
    check_name("attribute name", key, ATTR_KEY_RE)
    if isinstance(v, (list, tuple)):
        v = tuple(v)
        for item in v:
            if isinstance(item, (list, tuple)):
                raise _bad(f"attribute '{key}': nested tuples are not supported")
            _check_scalar(key, item)
        return v
    _check_scalar(key, v)
    return v


def normalize_attrs(attrs: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> tuple[tuple[str, AttrValue], ...]:
    items = list(attrs.items()) if isinstance(attrs, Mapping) else list(attrs or ())
    out = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise _bad(f"attributes must be (name, value) pairs, got {item!r}")
        out.append((item[0], normalize_attr(item[0], item[1])))
    out.sort(key=lambda kv: kv[0])
    for a, b in zip(out, out[1:]):
        if a[0] == b[0]:
            raise _bad(f"attribute '{a[0]}' given twice")
    return tuple(out)


def _scalar_key(v: Any) -> Any:
    # type-strict identity of a value: bool vs int vs float distinct; floats by repr (nan == nan, -0.0 != 0.0)
    if isinstance(v, float):
        return ("f", repr(v))
    return (type(v).__name__, v)


def attrs_key(attrs: tuple[tuple[str, AttrValue], ...]) -> tuple:
    return tuple((k, tuple(_scalar_key(x) for x in v) if isinstance(v, tuple) else _scalar_key(v))
                 for k, v in attrs)


# ---- ops -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Op:
    """One SSA operation. `results` and `types` run in parallel; `attrs` are sorted (name, value) pairs."""

    results: tuple[str, ...]
    op: str
    inputs: tuple[str, ...] = ()
    attrs: tuple[tuple[str, AttrValue], ...] = ()
    types: tuple[TensorType, ...] = ()
    loc: str = ""

    def __post_init__(self):
        for name in ("results", "inputs", "types"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                if isinstance(value, (str, TensorType)):
                    raise _bad(f"Op.{name} must be a tuple, got a single {type(value).__name__}")
                object.__setattr__(self, name, tuple(value))
        check_name("op name", self.op, OP_NAME_RE)
        for r in self.results:
            check_name("value name", r, VALUE_RE)
        for i in self.inputs:
            check_name("value name", i, VALUE_RE)
        if len(set(self.results)) != len(self.results):
            raise _bad(f"op '{self.op}' defines a result twice: {self.results}")
        for t in self.types:
            if not isinstance(t, TensorType):
                raise _bad(f"op '{self.op}': types must be TensorType, got {t!r}")
        if len(self.types) != len(self.results):
            raise _bad(f"op '{self.op}' has {len(self.results)} results but {len(self.types)} types")
        object.__setattr__(self, "attrs", normalize_attrs(self.attrs))
        if not isinstance(self.loc, str):
            raise _bad(f"op '{self.op}': loc must be a string")

    @classmethod
    def make(cls, results: str | Iterable[str], op: str, inputs: Iterable[str] = (),
             attrs: Mapping[str, Any] | None = None, types: TensorType | Iterable[TensorType] = (),
             loc: str = "") -> "Op":
        """Convenience constructor: a single result name / type may be given bare, attrs as a dict."""
        results = (results,) if isinstance(results, str) else tuple(results)
        types = (types,) if isinstance(types, TensorType) else tuple(types)
        return cls(results, op, tuple(inputs), attrs or (), types, loc)

    @cached_property
    def attr_dict(self) -> dict[str, AttrValue]:
        return dict(self.attrs)

    def attr(self, name: str, default: Any = _MISSING) -> AttrValue:
        d = self.attr_dict
        if name in d:
            return d[name]
        if default is _MISSING:
            raise KeyError(f"op %{self.name} = {self.op} has no attribute '{name}'")
        return default

    def has_attr(self, name: str) -> bool:
        return name in self.attr_dict

    @property
    def name(self) -> str:
        """The first result's name (how errors and graphs refer to the op)."""
        return self.results[0] if self.results else f"<{self.op}>"

    @property
    def result(self) -> str:
        if len(self.results) != 1:
            raise IRError(f"op has {len(self.results)} results, not 1", op=self.describe())
        return self.results[0]

    @property
    def type(self) -> TensorType:
        if len(self.types) != 1:
            raise IRError(f"op has {len(self.types)} results, not 1", op=self.describe())
        return self.types[0]

    def describe(self) -> str:
        return f"%{self.name} = {self.op}" if self.results else self.op

    def replace(self, **changes) -> "Op":
        """A copy with some fields changed (attrs may be a dict; the constructor normalizes)."""
        fields = dict(results=self.results, op=self.op, inputs=self.inputs, attrs=self.attrs, types=self.types,
                      loc=self.loc)
        fields.update(changes)
        return Op(**fields)

    def with_attrs(self, **updates: Any) -> "Op":
        merged = dict(self.attrs)
        merged.update(updates)
        return self.replace(attrs=merged)

    def key(self) -> tuple:
        """Structural identity (what __eq__ and __hash__ use)."""
        return (self.results, self.op, self.inputs, attrs_key(self.attrs), self.types, self.loc)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Op):
            return NotImplemented
        return self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __str__(self) -> str:
        return print_op(self)


# ---- modules ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Module:
    name: str
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, AttrValue], ...] = field(default=())

    def __post_init__(self):
        check_name("module name", self.name, MODULE_NAME_RE)
        for f in ("ops", "outputs"):
            if not isinstance(getattr(self, f), tuple):
                object.__setattr__(self, f, tuple(getattr(self, f)))
        for op in self.ops:
            if not isinstance(op, Op):
                raise _bad(f"Module.ops must hold Op, got {type(op).__name__}")
        for o in self.outputs:
            check_name("value name", o, VALUE_RE)
        object.__setattr__(self, "attrs", normalize_attrs(self.attrs))

    # Lookups are cached: a Module never changes.
    @cached_property
    def defs(self) -> dict[str, Op]:
        """value name -> defining op (the first definition when the module is malformed)."""
        out: dict[str, Op] = {}
        for op in self.ops:
            for r in op.results:
                out.setdefault(r, op)
        return out

    @cached_property
    def types(self) -> dict[str, TensorType]:
        out: dict[str, TensorType] = {}
        for op in self.ops:
            for r, t in zip(op.results, op.types):
                out.setdefault(r, t)
        return out

    @cached_property
    def users(self) -> dict[str, list[Op]]:
        """value name -> ops reading it (once per op)."""
        out: dict[str, list[Op]] = {}
        for op in self.ops:
            for v in dict.fromkeys(op.inputs):
                out.setdefault(v, []).append(op)
        return out

    @cached_property
    def attr_dict(self) -> dict[str, AttrValue]:
        return dict(self.attrs)

    def attr(self, name: str, default: Any = _MISSING) -> AttrValue:
        if name in self.attr_dict:
            return self.attr_dict[name]
        if default is _MISSING:
            raise KeyError(f"module @{self.name} has no attribute '{name}'")
        return default

    def type_of(self, value: str) -> TensorType:
        return self.types[value]

    def ops_named(self, opname: str) -> list[Op]:
        return [op for op in self.ops if op.op == opname]

    def params(self) -> dict[str, Op]:
        """weight name -> param op (first one when duplicated)."""
        out: dict[str, Op] = {}
        for op in self.ops:
            if op.op == "param":
                out.setdefault(op.attr("name"), op)
        return out

    def inputs(self) -> list[Op]:
        return self.ops_named("input")

    def replace(self, **changes) -> "Module":
        fields = dict(name=self.name, ops=self.ops, outputs=self.outputs, attrs=self.attrs)
        fields.update(changes)
        return Module(**fields)

    def key(self) -> tuple:
        return (self.name, self.ops, self.outputs, attrs_key(self.attrs))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Module):
            return NotImplemented
        return self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __str__(self) -> str:
        return print_module(self)
