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


def test_expected_rate_is_the_plan_times_the_measured_share():
    """Where k3c was measured end to end (h200), the plan also states what to expect: its rate times the share of
    the plan the measured runs reached; elsewhere it says the rate is a ceiling and names where it was measured."""
    kw = dict(context=256, batch=4, prefill_chunk=256)
    h200 = plan(TINY, "h200", **kw)
    d = h200.to_dict()
    for phase in ("prefill", "decode"):
        ph = d["phases"][phase]
        lo, hi = get_target("h200").plan_fraction_of(phase)
        assert ph["expected"]["measured_share"] == [lo, hi]
        assert ph["expected"]["tokens_per_s"] == pytest.approx([lo * ph["tokens_per_s"], hi * ph["tokens_per_s"]])
    assert d["phases"]["append-prefill"]["expected"] is None         # never measured: no share invented
    text = h200.text()
    rate = d["phases"]["decode"]["expected"]["tokens_per_s"]
    assert f"expected on h200: {rate[0]:,.1f}-{rate[1]:,.1f} tokens/s per replica" in text
    mi = plan(TINY, "mi355x", **kw)
    assert all(ph["expected"] is None for ph in mi.to_dict()["phases"].values())
    assert "expected on mi355x: not measured, read the rate above as a ceiling [share of the decode plan reached " \
           "where measured: h200 48-62%]" in mi.text()


def test_measured_shares_match_the_checked_in_measurements():
    """Target.plan_fraction is bench/plan_check.py's result over the checked-in H200 JSONs, rounded outwards to
    a percent: the table cannot drift from the data (rerun plan_check and update both together)."""
    import json
    import math

    with open(os.path.join(ROOT, "bench", "plan-check-h200.json"), encoding="utf-8") as fh:
        rows = json.load(fh)["rows"]
    h200 = get_target("h200")
    for phase in ("prefill", "decode"):
        ratios = [r["ratio"] for r in rows if r["phase"] == phase]
        assert len(ratios) >= 5
        assert h200.plan_fraction_of(phase) == (math.floor(min(ratios) * 100) / 100,
                                                math.ceil(max(ratios) * 100) / 100)
    assert [t for t in ("mi355x", "mi300x", "h100", "b200", "cpu") if get_target(t).plan_fraction] == []
