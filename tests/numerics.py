"""Error measures the tests share."""
from __future__ import annotations


def rel(a, b) -> float:
    """Relative L2 distance of `a` from `b`, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
