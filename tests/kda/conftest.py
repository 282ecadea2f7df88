"""Fixtures of the KDA kernel tests: single-threaded torch, no autograd, the reference helpers importable."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))   # refutil (fla naive loader, rel_err)


@pytest.fixture(autouse=True)
def _one_thread_no_grad(one_thread):
    with torch.no_grad():
        yield
