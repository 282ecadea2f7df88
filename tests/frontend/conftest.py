"""Shared paths for the spec-frontend tests."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
BAD_SPECS = Path(__file__).resolve().parent / "bad_specs"
PRESETS = ("k3-tiny.yaml", "kimi-k3.yaml", "kimi-linear-48b.yaml")


@pytest.fixture(scope="session")
def tiny_text() -> str:
    return (EXAMPLES / "k3-tiny.yaml").read_text()
