import math

import pytest

from k3c.errors import IRError
from k3c.ir import Module, Op, TensorType, parse_module, print_module

BF = TensorType("bf16", ("B", "T", 8))


def test_op_make_sorts_attrs_and_accessors():
    op = Op.make("y", "rmsnorm", ["x", "w"], {"eps": 1e-5, "layer": 3}, BF, loc="f.yaml:3")
    assert op.attrs == (("eps", 1e-5), ("layer", 3))
    assert op.attr("layer") == 3 and op.attr("missing", 7) == 7 and op.has_attr("eps")
    with pytest.raises(KeyError):
        op.attr("missing")
    assert op.result == "y" and op.type == BF and op.describe() == "%y = rmsnorm"
    # constructing directly with unsorted pairs or a dict gives the same canonical op
    assert Op(("y",), "rmsnorm", ("x", "w"), (("layer", 3), ("eps", 1e-5)), (BF,), "f.yaml:3") == op
    assert Op(("y",), "rmsnorm", ("x", "w"), {"layer": 3, "eps": 1e-5}, (BF,), "f.yaml:3") == op
    assert op.with_attrs(layer=4).attr("layer") == 4 and op.attr("layer") == 3   # immutable


def test_lists_become_tuples():
    op = Op.make("y", "foo", ["x"], {"dims": [1, 2]}, TensorType("f32", [2, "N"]))
    assert op.attr("dims") == (1, 2) and op.types[0].shape == (2, "N")


def test_equality_is_type_strict():
    def mk(v):
        return Op.make("y", "foo", [], {"a": v}, TensorType("f32", ()))

    assert mk(1) != mk(True)
    assert mk(1) != mk(1.0)
    assert mk(0.0) != mk(-0.0)
    assert mk(math.nan) == mk(float("nan")) and hash(mk(math.nan)) == hash(mk(float("nan")))
    assert mk((1, 2)) != mk((1.0, 2))
    assert len({mk(1), mk(True), mk(1.0)}) == 3


@pytest.mark.parametrize("build", [
    lambda: Op.make("x y", "foo"),                                  # bad value name
    lambda: Op.make("y", "foo bar"),                                # bad op name
    lambda: Op.make("y", "foo", ["a\"b"]),                          # bad input name
    lambda: Op.make("y", "foo", attrs={"bad key": 1}),              # bad attribute name
    lambda: Op.make("y", "foo", attrs={"a": {"x": 1}}),             # unsupported value
    lambda: Op.make("y", "foo", attrs={"a": ((1, 2),)}),            # nested tuple
    lambda: Op.make("y", "foo", types=()),                          # result without a type
    lambda: Op.make(["y", "y"], "foo", types=(BF, BF)),             # result twice
    lambda: TensorType("bf16", (-1,)),                              # negative dim
    lambda: TensorType("bf16", ("B+1",)),                           # dim is not a symbol
    lambda: TensorType("BF16!", ()),                                # bad dtype
    lambda: Module("bad name", (), ()),                             # bad module name
    lambda: Op(("y",), "foo", ("x",), (("a", 1), ("a", 2)), (BF,)),  # attribute twice
])
def test_constructors_validate(build):
    with pytest.raises(IRError):
        build()


def test_module_lookups():
    x = Op.make("x", "input", [], {"name": "x"}, BF)
    w = Op.make("w", "param", [], {"name": "norm.weight"}, TensorType("bf16", (8,)))
    y = Op.make("y", "rmsnorm", ["x", "w"], {"eps": 1e-5}, BF)
    m = Module("m", (x, w, y), ("y",), {"k": "v"})
    assert m.defs["y"] is y and m.types["w"].shape == (8,)
    assert m.users["x"] == [y] and m.params() == {"norm.weight": w} and m.inputs() == [x]
    assert m.attr("k") == "v" and m.replace(outputs=("x",)).outputs == ("x",)
    assert str(m) == print_module(m) and parse_module(str(m)) == m


def test_builder_infers_types_and_names_the_op_on_errors():
    from k3c.ir import Builder, verify

    b = Builder("b", {"dtype": "bf16"})
    x = b.declare("input", BF, {"name": "x"}, name="x")
    w = b.declare("param", TensorType("bf16", (8,)), {"name": "norm.weight"}, prefix="w")
    y = b.op("rmsnorm", [x, w], {"eps": 1e-5}, "f.yaml:1", prefix="y")
    assert (w, y) == ("w0", "y1") and b.types[y] == BF
    m = verify(b.build([y]))
    with pytest.raises(IRError, match="rhs: expected bf16\\[B, T, 8\\]") as info:
        b.op("add", [y, w], {}, "f.yaml:2", name="bad")
    assert info.value.op == "%bad = add" and info.value.loc == "f.yaml:2"
    b2 = Builder.like(m)
    assert b2.fresh("w") == "w1" and b2.types["y1"] == BF      # w0 exists: skipped
