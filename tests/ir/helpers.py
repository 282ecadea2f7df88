"""Shared test helpers: example specs and their (cached) IR modules."""
import os
from pathlib import Path

from k3c.frontend import load_spec
from k3c.frontend.to_ir import spec_to_module

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))


def example_spec(name: str):
    return load_spec(os.path.join(ROOT, "examples", name))


_MODULES = {}


def example_module(name: str):
    if name not in _MODULES:
        _MODULES[name] = spec_to_module(example_spec(name))
    return _MODULES[name]
