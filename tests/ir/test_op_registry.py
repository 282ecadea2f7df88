"""The op registry is composed from the op families' OP_DEFS, explicitly: every family listed, no name twice."""
import pkgutil
import types

import pytest

import k3c.ir
from k3c.errors import IRError
from k3c.ir.opdef import OpDef, fixed_roles
from k3c.ir.ops import FAMILIES, compose_registry, registered_ops


def test_every_family_module_is_listed_and_every_op_registered():
    families = {m.name for m in pkgutil.iter_modules(k3c.ir.__path__) if m.name.endswith("_ops")}
    assert {f.__name__.rsplit(".", 1)[1] for f in FAMILIES} == families
    ops = registered_ops()
    assert sum(len(f.OP_DEFS) for f in FAMILIES) == len(ops)
    assert all(ops[d.name] is d for f in FAMILIES for d in f.OP_DEFS)


def test_a_name_defined_twice_is_an_error():
    a = types.SimpleNamespace(__name__="fam_a", OP_DEFS=(OpDef("twice", fixed_roles("x")),))
    b = types.SimpleNamespace(__name__="fam_b", OP_DEFS=(OpDef("twice", fixed_roles("y")),))
    assert set(compose_registry([a])) == {"twice"}
    with pytest.raises(IRError, match="op 'twice' is defined twice: by fam_a and by fam_b"):
        compose_registry([a, b])


def test_weight_transforms_are_marked_on_their_opdef():
    ops = registered_ops()
    assert {n for n, d in ops.items() if d.weight_transform} == {"mla_kvb_split", "attn_res_fold_queries"}
