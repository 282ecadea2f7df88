import networkx as nx
import onnx
import pytest

from k3c.ir import Module, Op, TensorType, parse_module
from k3c.ir.dot import to_dot
from k3c.ir.graph import to_networkx
from k3c.ir.onnx_export import DOMAIN, to_onnx

from .helpers import EXAMPLES, example_module


@pytest.mark.parametrize("name", EXAMPLES)
def test_onnx_checker_passes(name):
    m = example_module(name)
    model = to_onnx(m)
    onnx.checker.check_model(model)
    graph = model.graph
    compute = [op for op in m.ops if op.op not in ("input", "param")]
    assert len(graph.node) == len(compute)
    assert {n.domain for n in graph.node} == {DOMAIN}
    assert len(graph.input) == len(m.ops) - len(compute) and not graph.initializer
    assert [o.name for o in graph.output] == ["logits"]
    ids = next(i for i in graph.input if i.name == "input_ids")
    assert [d.dim_param for d in ids.type.tensor_type.shape.dim] == ["B", "T"]
    kda = next((n for n in graph.node if n.op_type == "kda"), None)
    if kda is not None:
        assert kda.input[1].endswith("self_attn.q_proj.weight")       # weights keep their canonical names
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in kda.attribute}
        assert attrs["gate"] in (b"safe", b"softplus") and attrs["layer"] == 0
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["hidden_size"] == str(m.attr("hidden_size"))


def test_onnx_odd_attrs_and_repeated_outputs():
    t = TensorType("fp8e4m3", ("N", 2))
    m = Module("odd", (
        Op.make("x", "input", [], {"name": "x"}, t),
        Op.make("y", "custom", ["x"], {"n": None, "b": True, "mixed": (1, "a", 2.5), "e": (), "fs": (1.5,)}, t),
    ), ("y", "y"))
    model = to_onnx(m)
    onnx.checker.check_model(model)
    assert [o.name for o in model.graph.output][0] == "y" and len(model.graph.output) == 2


@pytest.mark.parametrize("name", EXAMPLES)
def test_dot_contains_every_op(name):
    m = example_module(name)
    dot = to_dot(m)
    assert dot.startswith(f'digraph "{m.name}" {{') and dot.rstrip().endswith("}")
    for i, op in enumerate(m.ops):
        assert f"  n{i} [label=\"%{op.results[0]} = {op.op}" in dot
    compact = to_dot(m, include_params=False)
    assert "= param" not in compact and ("= kda" in compact or "= mla" in compact)


def test_dot_escapes_labels():
    m = parse_module('module @m {\n  %x = input() {name = "x"} : f32[2] loc("a\\"b\\\\c\\nd")\n  return %x\n}\n')
    dot = to_dot(m)
    assert 'tooltip="a\\"b\\\\c\\nd"' in dot


def test_networkx_view():
    m = example_module("k3-tiny.yaml")
    g = to_networkx(m)
    assert g.number_of_nodes() == len(m.ops) and nx.is_directed_acyclic_graph(g)
    assert [m.ops[i] for i in nx.lexicographical_topological_sort(g)] == list(m.ops)
    kda = next(i for i, op in enumerate(m.ops) if op.op == "kda")
    assert {m.ops[i].op for i in nx.ancestors(g, kda)} == {"input", "param", "embedding", "rmsnorm"}
    assert g.graph["outputs"] == [i for i, op in enumerate(m.ops) if "logits" in op.results]
