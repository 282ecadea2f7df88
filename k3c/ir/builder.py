"""Builder: appends ops with fresh names and infers their result types from the op registry.

The frontend and rewriting passes build through it, so result types always agree with the verifier's rules.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..errors import IRError
from .core import Module, Op, TensorType, normalize_attrs
from .opdef import TypeCheck
from .ops import bind_inputs, get_op_def


class Builder:
    def __init__(self, name: str, attrs: Mapping[str, Any] | None = None, *, taken: Iterable[str] = ()):
        self.name = name
        self.attrs = dict(attrs or {})
        self.ops: list[Op] = []
        self.types: dict[str, TensorType] = {}
        self._taken = set(taken)
        self._counter = 0

    def fresh(self, prefix: str = "v") -> str:
        """A new value name `prefix<N>`; N counts across prefixes so names read in program order."""
        while True:
            name = f"{prefix}{self._counter}"
            self._counter += 1
            if name not in self._taken:
                self._taken.add(name)
                return name

    def append(self, op: Op) -> Op:
        self.ops.append(op)
        self._taken.update(op.results)
        self.types.update(zip(op.results, op.types))
        return op

    def op(self, opname: str, inputs: Iterable[str], attrs: Mapping[str, Any] | None = None, loc: str = "", *,
           prefix: str = "v", name: str | None = None) -> str:
        """Append a single-result op whose type the registry infers; return its result name."""
        op = self.make(opname, inputs, attrs, loc, results=(name or self.fresh(prefix),))
        self.append(op)
        return op.results[0]

    def make(self, opname: str, inputs: Iterable[str], attrs: Mapping[str, Any] | None, loc: str, *,
             results: tuple[str, ...]) -> Op:
        """An op with inferred types (not appended)."""
        inputs = tuple(inputs)
        opdef = get_op_def(opname)
        if opdef is None or opdef.infer is None:
            raise IRError(f"cannot infer the type of op '{opname}'", op=opname, loc=loc or None)
        attrs = dict(normalize_attrs(attrs))
        what = f"%{results[0]} = {opname}" if results else opname
        roles = opdef.roles(attrs)
        if len(roles) != len(inputs):
            raise IRError(f"expects {len(roles)} inputs ({', '.join(r.name for r in roles)}), got {len(inputs)}",
                          op=what, loc=loc or None)
        try:
            if opdef.check is not None:
                opdef.check(attrs)
            ins = {role: self.types[v] for role, v in bind_inputs(opname, attrs, inputs).items()}
            types = tuple(opdef.infer(attrs, ins))
        except TypeCheck as e:
            raise IRError(str(e), op=what, loc=loc or None) from None
        return Op(results, opname, inputs, attrs, types, loc)

    def declare(self, opname: str, ty: TensorType, attrs: Mapping[str, Any], loc: str = "", *,
                prefix: str = "v", name: str | None = None) -> str:
        """Append an op whose type is declared (input, param)."""
        op = Op((name or self.fresh(prefix),), opname, (), attrs, (ty,), loc)
        self.append(op)
        return op.results[0]

    def build(self, outputs: Iterable[str]) -> Module:
        return Module(self.name, tuple(self.ops), tuple(outputs), self.attrs)

    @classmethod
    def like(cls, module: Module) -> "Builder":
        """An empty builder for rewriting `module`: same name and attrs, its value names and types known."""
        b = cls(module.name, module.attr_dict, taken=module.defs)
        b.types.update(module.types)
        return b
