"""Fixtures of the MoE tests: single-threaded torch, no autograd."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_no_grad(one_thread):
    with torch.no_grad():
        yield
