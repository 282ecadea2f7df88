"""Shared fixtures of the Hugging Face import tests."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def _single_threaded(one_thread):
    # tiny models: OpenMP threads only add contention
    yield
