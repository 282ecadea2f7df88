"""The emitter table: the union of the family modules' EMITTERS, the override families applied last."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from k3c.codegen import catalogue
from k3c.ir.ops import get_op_def


def _family(name, **emitters):
    return SimpleNamespace(__name__=name, EMITTERS=emitters)


def test_compose_refuses_an_op_defined_twice():
    a, b = _family("a", x=1), _family("b", x=2)
    with pytest.raises(ValueError, match="'x' defined by both a and b"):
        catalogue.compose((a, b), ())
    with pytest.raises(ValueError, match="'x' defined by both a and b"):
        catalogue.compose((), (a, b))


def test_overrides_take_precedence_and_may_add():
    table = catalogue.compose((_family("base", x=1, y=2),), (_family("over", x=3, z=4),))
    assert table == {"x": 3, "y": 2, "z": 4}


def test_the_composed_table():
    for family in catalogue.FAMILIES + catalogue.OVERRIDES:
        for name, fn in family.EMITTERS.items():
            assert get_op_def(name) is not None, f"{family.__name__} has an emitter for unknown op {name!r}"
            if family in catalogue.FAMILIES and name not in catalogue.mxfp4.EMITTERS:
                assert catalogue.EMITTERS[name] is fn
    for name, fn in catalogue.mxfp4.EMITTERS.items():
        assert catalogue.EMITTERS[name] is fn
    assert catalogue.EMITTERS["mlp"] is not catalogue.basic.EMITTERS["mlp"]
