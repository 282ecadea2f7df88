"""Catalogues bound to a device slot (k3c.runtime.launcher.bind): models sharing a device under one target and
policy share its binding; another target or policy replaces it. Checked on a slot no test launches on."""
from __future__ import annotations

import pytest

from k3c.codegen.targets import get_target
from k3c.runtime import launcher

SLOT = "cuda:7"


@pytest.fixture(autouse=True)
def _unbound():
    launcher.unbind(SLOT)
    yield
    launcher.unbind(SLOT)


def _cat(root, keys, target="h200"):
    return launcher.Catalogue(get_target(target), root, {k: f"{root}:{k}" for k in keys})


def _find(key):
    b = launcher._BINDINGS.get(launcher._device_slot(SLOT))
    hit = b.find(key) if b is not None else None
    return None if hit is None else (hit[0].root, hit[1])


def test_second_model_on_a_device_joins_the_first():
    launcher.bind(SLOT, _cat("target", ["a", "shared"]))
    launcher.bind(SLOT, _cat("draft", ["b", "shared"]))
    assert _find("a") == ("target", "target:a")
    assert _find("b") == ("draft", "draft:b")
    assert _find("shared") == ("draft", "draft:shared")       # the latest binding first: the same code either way
    assert _find("c") is None
    launcher.bind(SLOT, _cat("target", ["a", "shared"]))        # rebinding an artifact does not list it twice
    assert [c.root for c in launcher._BINDINGS[launcher._device_slot(SLOT)].catalogues] == ["target", "draft"]


@pytest.mark.parametrize("target, policy", [("h100", "artifact"), ("h200", "strict")])
def test_another_target_or_policy_replaces(target, policy):
    launcher.bind(SLOT, _cat("first", ["a"]))
    launcher.bind(SLOT, _cat("second", ["b"], target=target), policy)
    assert _find("a") is None and _find("b") == ("second", "second:b")


def test_unbind_drops_every_catalogue():
    launcher.bind(SLOT, _cat("target", ["a"]))
    launcher.bind(SLOT, _cat("draft", ["b"]))
    launcher.unbind(SLOT)
    assert _find("a") is None and _find("b") is None
