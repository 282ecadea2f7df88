"""bench/serve_load.py --mixed in its small mode (CPU, k3-tiny): long prompts arriving while streams decode, the
step budget off and on in one invocation; the figures are there and sane, and the budget bounds every step."""
import json


def test_mixed_workload_off_and_on(bench_script, tmp_path, one_thread):
    serve_load = bench_script("serve_load")
    out = tmp_path / "mixed.json"
    res = serve_load.main(["--mixed", "--spec", "examples/k3-tiny.yaml", "--device", "cpu", "--no-kernels", "--small",
                           "--compare", "--no-warmup", "--out", str(out)])
    assert json.loads(out.read_text())["configs"].keys() == {"off", "on"}
    off, on = res["configs"]["off"], res["configs"]["on"]
    assert (off["max_step_tokens"], on["max_step_tokens"]) == (None, 24)
    assert off["most_step_tokens"] > 24 >= on["most_step_tokens"]     # 4 streams + 3 prompts of 40-90 tokens
    assert on["steps"] > off["steps"]
    for r in (off, on):
        assert 0 < r["itl_ms"]["p50"] <= r["itl_ms"]["p90"] <= r["itl_ms"]["p99"]
        assert 0 < r["ttft_long_ms"]["p50"] <= r["ttft_long_ms"]["p90"]
        assert r["tokens_per_s"] > r["generated_tokens_per_s"] > 0
        assert r["peak_gpu_bytes"] is None and r["streams_ended_early"] == 0
        assert r["long_prompt_tokens"] == off["long_prompt_tokens"]      # the same workload
