"""ONNX view of any IR stage (for Netron and interchange): every op becomes a node of the custom domain "ai.k3c".

Model inputs and weights are graph inputs with full type info and no data (a weight's ONNX name is its canonical
weight name); symbolic dims become dim_param; each node's doc_string is its loc; module attrs go to
metadata_props. Float attrs are stored as ONNX FLOAT (32-bit); the IR text stays the exact form.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..errors import IRError
from .core import Module, TensorType
from .printer import format_scalar, format_value

DOMAIN = "ai.k3c"
DOMAIN_VERSION = 1
DEFAULT_OPSET = 21

_ELEM = {
    "f64": TensorProto.DOUBLE, "f32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "f16": TensorProto.FLOAT16,
    "fp8e4m3": TensorProto.FLOAT8E4M3FN, "fp8e5m2": TensorProto.FLOAT8E5M2,
    "fp4e2m1": getattr(TensorProto, "FLOAT4E2M1", TensorProto.UINT8),
    "e8m0": getattr(TensorProto, "FLOAT8E8M0", TensorProto.UINT8),
    "i64": TensorProto.INT64, "i32": TensorProto.INT32, "i16": TensorProto.INT16, "i8": TensorProto.INT8,
    "u8": TensorProto.UINT8, "bool": TensorProto.BOOL,
}


def _value_info(name: str, t: TensorType) -> onnx.ValueInfoProto:
    if t.dtype not in _ELEM:
        raise IRError(f"no ONNX element type for dtype '{t.dtype}'")
    return helper.make_tensor_value_info(name, _ELEM[t.dtype], list(t.shape))


def _attribute(key: str, v) -> onnx.AttributeProto:
    A = onnx.AttributeProto
    if v is None:
        return helper.make_attribute(key, "none")
    if isinstance(v, bool):
        return helper.make_attribute(key, int(v))
    if isinstance(v, (int, float, str)):
        return helper.make_attribute(key, v)
    if not v:
        return helper.make_attribute(key, [], attr_type=A.INTS)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return helper.make_attribute(key, list(v), attr_type=A.INTS)
    if all(isinstance(x, float) for x in v):
        return helper.make_attribute(key, list(v), attr_type=A.FLOATS)
    if all(isinstance(x, str) for x in v):
        return helper.make_attribute(key, list(v), attr_type=A.STRINGS)
    return helper.make_attribute(key, [format_scalar(x) for x in v], attr_type=A.STRINGS)


def to_onnx(module: Module) -> onnx.ModelProto:
    """An onnx.ModelProto that passes onnx.checker.check_model (custom-domain nodes, no weight data)."""
    names: dict[str, str] = {}          # SSA value -> ONNX name
    taken: set[str] = set()

    def claim(value: str, preferred: str) -> str:
        name = preferred if preferred not in taken else value
        while name in taken:
            name = "_" + name
        taken.add(name)
        names[value] = name
        return name

    inputs, nodes, value_info = [], [], []
    for op in module.ops:
        if op.op in ("input", "param"):
            name = claim(op.results[0], str(op.attr("name", op.results[0])))
            vi = _value_info(name, op.types[0])
            vi.doc_string = f"{op.op} %{op.results[0]}" + (f" at {op.loc}" if op.loc else "")
            inputs.append(vi)
            continue
        outs = [claim(r, r) for r in op.results]
        node = helper.make_node(op.op, [names[i] for i in op.inputs], outs, name=f"{op.op}_{op.name}",
                                domain=DOMAIN, doc_string=op.loc or None)
        node.attribute.extend(_attribute(k, v) for k, v in op.attrs)
        nodes.append(node)
        value_info.extend(_value_info(n, t) for n, t in zip(outs, op.types))

    outputs, emitted = [], set()
    types = module.types
    for o in module.outputs:
        name = names[o]
        if name in emitted:             # ONNX outputs must be distinct: repeat through an Identity
            alias = claim(f"{o}_out{len(emitted)}", f"{o}_out{len(emitted)}")
            nodes.append(helper.make_node("Identity", [name], [alias], name=f"Identity_{alias}"))
            name = alias
        emitted.add(name)
        outputs.append(_value_info(name, types[o]))
    value_info = [vi for vi in value_info if vi.name not in emitted]     # graph outputs carry their own

    graph = helper.make_graph(nodes, module.name, inputs, outputs, value_info=value_info,
                              doc_string=f"k3c IR module @{module.name}")
    model = helper.make_model(graph, producer_name="k3c", opset_imports=[
        helper.make_opsetid("", DEFAULT_OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    for k, v in module.attrs:
        entry = model.metadata_props.add()
        entry.key, entry.value = k, format_value(v)
    return model
