"""Shared fixtures of the Hugging Face import tests."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models: OpenMP threads only add contention on a busy 2-core box; restore the setting afterwards
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
