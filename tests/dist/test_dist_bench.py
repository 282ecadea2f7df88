"""bench/dist.py end to end on the CPU (gloo): a layout sweep whose sharded logits are checked against the one-rank
layout's, and whose JSON carries the figures the multi-GPU run reports (issue 11)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_layout_sweep_matches_one_rank(tmp_path):
    out = tmp_path / "dist.json"
    # a subprocess, as users run it: the spawned ranks import the bench by its file's module name
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "dist.py"), "--configs", "1x1,2x1,1x2",
                          "--device", "cpu", "--spec", os.path.join(ROOT, "examples", "k3-tiny.yaml"), "--batch", "2",
                          "--prompt-len", "9", "--decode", "2", "--reps", "1", "--routing-replay", "--out", str(out)],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    lays = report["layouts"]
    assert [(x["tp"], x["ep"]) for x in lays] == [(1, 1), (2, 1), (1, 2)]
    assert all("error" not in x for x in lays)
    for lay in lays[1:]:
        assert lay["vs"] == "1x1"
        # fp32, split summation orders: the same bounds as tests/dist/test_dist_logits.py
        assert lay["rel_err_prefill"] < 1e-5 and lay["rel_err_decode_max"] < 4e-5
        assert len(lay["ranks"]) == 2
        # the first layout's expert choices replayed: every router call of prefill (2 x 9 tokens) and the 2 decode
        # steps (2 tokens each) of every MoE layer, and a logits error as small as the free run's (rank 0's count)
        calls = lays[0]["ranks"][0]["router_calls"]                  # recorded: 3 calls per MoE layer
        assert calls > 0 and calls % 3 == 0 and lay["ranks"][0]["router_calls"] == calls
        # every layout's routed experts see every token of the prompt (EP 1: each expert split over the TP ranks)
        assert lay["routing_decisions"] == calls // 3 * (2 * 9 + 2 * 2)
        assert 0 <= lay["routing_flips"] <= lay["routing_decisions"]
        assert lay["replay_rel_err_prefill"] < 1e-5 and lay["replay_rel_err_decode_max"] < 4e-5
        tp_split = lay["tp"] > 1
        # TP all-reduces / gathers every layer; EP alone reduces the routed MoE output only
        assert all(r["prefill_collective_calls"] > 0 and r["decode_collective_calls"] > 0 for r in lay["ranks"])
        assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in lay["ranks"])
        if tp_split:
            assert lay["ranks"][0]["weight_bytes"] < lays[0]["ranks"][0]["weight_bytes"]
        # the decode ceiling: the one-rank weight bytes over this layout's busiest rank's (> 1: every split saves)
        assert lay["decode_weight_ceiling"] == pytest.approx(
            lays[0]["ranks"][0]["weight_bytes"] / max(r["weight_bytes"] for r in lay["ranks"]))
        assert lay["decode_weight_ceiling"] > 1.0
    assert "vs 1x1: logits rel err" in run.stdout


def test_bad_layout_text_is_a_clear_error(bench_script):
    with pytest.raises(SystemExit, match="'2y1' is not TPxEP"):
        bench_script("dist").parse_configs("1x1,2y1")
    with pytest.raises(SystemExit, match="'2x1@fp8': dtype must be one of"):
        bench_script("dist").parse_configs("1x1,2x1@fp8")
    assert bench_script("dist").parse_configs("1x1@float32,2x2") == [(1, 1, "float32"), (2, 2, None)]
