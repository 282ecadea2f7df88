"""The runtime's op tables: kernel_impls composes its families' KERNEL_IMPLS / TORCH_IMPLS (a name in two families
is refused, an override family replaces entries), and the executor's torch table is its own layer ops plus the
families' ops, without a name in both."""
from __future__ import annotations

import types

import pytest

from k3c.runtime import executor, kernel_impls


def _family(name, kernel=None, torch=None):
    return types.SimpleNamespace(__name__=name, KERNEL_IMPLS=kernel or {}, TORCH_IMPLS=torch or {})


def test_compose_refuses_a_name_two_families_define():
    a, b = _family("fam_a", {"op": len}), _family("fam_b", {"op": abs})
    with pytest.raises(ValueError, match="'op' defined by both fam_a and fam_b"):
        kernel_impls.compose((a, b), (), "KERNEL_IMPLS")


def test_overrides_replace_base_entries():
    base, mx = _family("float", {"op": len, "other": abs}), _family("mx", {"op": max})
    assert kernel_impls.compose((base,), (mx,), "KERNEL_IMPLS") == {"op": max, "other": abs}
    with pytest.raises(ValueError, match="defined by both mx and mx2"):
        kernel_impls.compose((base,), (mx, _family("mx2", {"op": min})), "KERNEL_IMPLS")


def test_the_tables_hold_the_families_entries_by_name():
    for family in kernel_impls.FAMILIES + kernel_impls.OVERRIDES:
        for fn in family.KERNEL_IMPLS.values():
            assert fn.__name__.startswith(("launch_", "torch_")), (family.__name__, fn.__name__)
        for fn in family.TORCH_IMPLS.values():
            assert fn.__name__.startswith("torch_"), (family.__name__, fn.__name__)
    assert kernel_impls.KERNEL_IMPLS["mlp"] is kernel_impls.mxfp4_linear.KERNEL_IMPLS["mlp"]
    assert kernel_impls.KERNEL_IMPLS["rmsnorm"] is kernel_impls.basic.launch_rmsnorm


def test_executor_torch_table():
    assert not executor.LAYER_IMPLS.keys() & kernel_impls.TORCH_IMPLS.keys()
    assert executor.TORCH_IMPLS == {**executor.LAYER_IMPLS, **kernel_impls.TORCH_IMPLS}
    assert all(fn.__name__.startswith("torch_") for fn in executor.LAYER_IMPLS.values())
