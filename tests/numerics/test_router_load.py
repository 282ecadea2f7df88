"""bench/router_load.py on a small sample: router scores of the trained example model recorded over held-out text,
`k3c calibrate-router` on them, expert load before and after."""
from __future__ import annotations

import json

import pytest

from trained_checks import needs_example


@needs_example
def test_calibration_does_not_worsen_the_recorded_load(bench_script, tmp_path, capsys):
    out = tmp_path / "load.json"
    assert bench_script("router_load").main(["--tokens", "1025", "--window", "256", "--threads", "1",
                                             "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["layer"] for r in rep["layers"]] == list(range(1, 8))        # every layer but the dense first one
    assert rep["windows"] == 4
    for r in rep["layers"]:
        # the recorded scores are the router's own: topk(scores + trained bias) gives the picks the model made
        assert r["recorded_trained"] == pytest.approx(r["picks_trained"], abs=1e-12), r
        assert r["recorded_calibrated"] <= r["recorded_trained"], r
        assert r["recorded_calibrated"] >= 1.0
    printed = capsys.readouterr().out
    assert "k3c: Quantile Balancing" in printed and "| worst |" in printed


def test_bad_model_directory_is_a_clear_error(bench_script, tmp_path):
    with pytest.raises(SystemExit, match="no model.safetensors"):
        bench_script("router_load").main(["--model", str(tmp_path)])
