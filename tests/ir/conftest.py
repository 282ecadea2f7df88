import pytest

from .helpers import ROOT


@pytest.fixture
def in_root(monkeypatch):
    """Run from the repo root, so specs load by relative path and locs read examples/<file>:<line>."""
    monkeypatch.chdir(ROOT)
    return ROOT
