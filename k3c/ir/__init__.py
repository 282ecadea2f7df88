"""The k3c IR: immutable SSA modules of layer- and kernel-level ops, their text form, registry and verifier.

    from k3c.ir import Module, Op, TensorType, print_module, parse_module, verify
"""
from .builder import Builder
from .core import FLOAT_DTYPES, INT_DTYPES, DTYPE_BITS, AttrValue, Module, Op, TensorType
from .opdef import AttrSpec, OpDef, Role, TypeCheck
from .ops import get_op_def, registered_ops
from .parser import parse_file, parse_module
from .printer import print_module, print_op
from .verifier import check_module, verify

parse = parse_module

__all__ = ["Builder", "Module", "Op", "TensorType", "AttrValue", "DTYPE_BITS", "FLOAT_DTYPES", "INT_DTYPES",
           "AttrSpec", "OpDef", "Role", "TypeCheck", "get_op_def", "registered_ops",
           "parse", "parse_module", "parse_file", "print_module", "print_op", "verify", "check_module"]
