"""bench/agentic_load.py in its small mode (CPU, k3-tiny, virtual clock, so the admission decisions and hit rates
depend only on page counts, not on this machine's speed): under the page budget every configuration hits alike;
past it LRU falls off the cliff, the working-set policy holds, the host tier holds more; the figures are sane and the
per-turn KV bytes follow the cache's layout."""
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

import agentic_load  # noqa: E402

TINY = "examples/k3-tiny.yaml"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("agentic") / "load.json"
    assert agentic_load.main(["--spec", TINY, "--device", "cpu", "--no-kernels", "--small", "--concurrency", "2,8",
                              "--sessions-factor", "1", "--per-turn", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _points(r):
    return {(p["config"], p["concurrency"]): p for p in r["points"]}


def test_hit_rates_under_and_past_the_budget(sweep):
    p = _points(sweep)
    under = {c: p[(c, 2)]["hit_rate"] for c in agentic_load.CONFIGS}
    assert len(set(under.values())) == 1 and under["lru"] > 0.7        # room for all: the same hits everywhere
    past = {c: p[(c, 8)]["hit_rate"] for c in agentic_load.CONFIGS}
    assert past["lru"] < under["lru"] - 0.2                             # the cliff
    assert past["working-set"] > past["lru"] + 0.15                     # the policy holds
    assert past["lru+host"] > past["lru"] + 0.15 and past["ws+host"] >= past["working-set"]
    assert p[("working-set", 8)]["admission_waits"] > 0 and p[("lru", 2)]["admission_waits"] == 0
    assert p[("lru+host", 8)]["cache"]["restored_host"] > 0


def test_figures_and_kv_bytes(sweep):
    import k3c

    spec = k3c.load_spec(TINY)
    mla_layers = sum(k == "mla" for k in spec.layer_kinds)
    row = (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * 4              # fp32 rows on the CPU
    kda = spec.kda
    heads, dk = kda.num_heads, kda.head_dim
    kda_layers = sum(k == "kda" for k in spec.layer_kinds)
    state = kda_layers * (heads * dk * dk * 4 + 3 * heads * dk * (kda.conv_kernel - 1) * 4)
    for p in sweep["points"]:
        assert p["turns"] == sum(1 for t in p["per_turn"])
        assert 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["p90"] <= p["ttft_ms"]["p99"]
        assert 0 < p["itl_ms"]["p50"] <= p["itl_ms"]["p99"]
        assert p["tokens_per_s"] > p["generated_tokens_per_s"] > 0
        for t in p["per_turn"]:
            assert t["kv_bytes"] == t["prompt"] * mla_layers * row + state
            assert 0 <= t["resumed"] < t["prompt"] and t["prefill_s"] > 0 and t["queued_s"] >= 0
        later = [t for t in p["per_turn"] if t["turn"] > 0]
        assert p["hit_rate_later_turns"] == pytest.approx(sum(t["resumed"] for t in later)
                                                          / sum(t["prompt"] for t in later))


def test_step_budget_flag(tmp_path):
    """--max-step-tokens reaches the engines of a (one-session) point: it runs, its later turns hit, it is recorded."""
    out = tmp_path / "budget.json"
    assert agentic_load.main(["--spec", TINY, "--device", "cpu", "--no-kernels", "--small", "--concurrency", "1",
                              "--configs", "lru", "--sessions-factor", "1", "--max-step-tokens", "16",
                              "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["args"]["max_step_tokens"] == 16
    (p,) = r["points"]
    assert p["hit_rate"] > 0.5 and p["tokens_per_s"] > 0
