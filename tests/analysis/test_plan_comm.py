"""The plan's communication term: ring all-reduce bytes at link bandwidth plus one latency per collective
(Target.collective_latency_s; H200 measured by bench/collectives.py), none at TP 1."""
import os

import pytest

from k3c.analysis import plan
from k3c.codegen.targets import get_target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "k3-tiny.yaml")


def test_collectives_pay_latency():
    kw = dict(context=256, batch=4, prefill_chunk=256)
    one = plan(TINY, "h200", **kw).to_dict()
    assert one["phases"]["decode"]["collectives"] == 0 and one["phases"]["decode"]["comm_seconds"] == 0
    two = plan(TINY, "h200", tp=2, **kw).to_dict()
    dec = two["phases"]["decode"]
    # 8 layers: one all-reduce after attention; 7 MoE (latent + hidden) and 1 dense MLP; the vocab-parallel
    # embedding's all-reduce
    assert dec["collectives"] == 8 + 7 * 2 + 1 + 1
    lat = get_target("h200").collective_latency_s
    assert lat == pytest.approx(9e-6)
    assert dec["comm_seconds"] == pytest.approx(dec["comm_bytes"] / 450e9 + dec["collectives"] * lat)
    assert two["target"]["collective_latency_s"] == lat
    # a prefill of 4 prompts pays the same collectives per prompt step, 4 times
    assert two["phases"]["prefill"]["collectives"] == 4 * dec["collectives"]
