"""bench/drift.py: bf16 against fp32 sublayer by sublayer on k3-tiny (CPU, seconds), with the fp32 run's expert
choices replayed and without."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_drift_report(bench_script, tmp_path, capsys):
    out = tmp_path / "drift.json"
    spec = os.path.join(ROOT, "examples", "k3-tiny.yaml")
    assert bench_script("drift").main(["--spec", spec, "--len", "24", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert len(rep["sublayers"]) == 16 and rep["sublayers"][0]["sublayer"] == "layer 0 kda"
    assert rep["replayed"] and rep["routing_decisions"] == 7 * 2 * 24      # 7 MoE layers, 48 tokens
    first = rep["sublayers"][0]["rel_err_in"]
    assert 1e-4 < first < 1e-2                      # the embedding's own bf16 rounding
    assert rep["logits_rel_err"] > 3 * first and rep["growth_per_sublayer"] > 1.0   # this random model amplifies
    assert "| layer 7 ffn |" in capsys.readouterr().out
    assert bench_script("drift").main(["--spec", spec, "--len", "24", "--no-replay", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["routing_flips"] is None


def test_drift_bad_spec_is_a_clear_error(bench_script, capsys):
    assert bench_script("drift").main(["--spec", "no-such.yaml"]) == 2
    assert "no-such.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--batch and --len must be positive"):
        bench_script("drift").main(["--spec", os.path.join(ROOT, "examples", "k3-tiny.yaml"), "--len", "0"])
