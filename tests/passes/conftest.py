from pathlib import Path

import pytest

from k3c.frontend import load_spec
from k3c.frontend.to_ir import spec_to_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny():
    """The IR of examples/k3-tiny.yaml."""
    return spec_to_module(load_spec(str(ROOT / "examples" / "k3-tiny.yaml")))
