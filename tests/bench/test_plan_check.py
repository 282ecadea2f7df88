"""bench/plan_check.py over the checked-in H200 measurements: `k3c plan`'s roofline must bound every measured
tokens/s from above (a plan below a measurement is a wrong plan: it caught TP 2 x EP 1 being charged every expert
as a dense linear), and the code reaches a plausible share of it."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_plan_bounds_every_measurement(bench_script, tmp_path, capsys):
    out = tmp_path / "check.json"
    assert bench_script("plan_check").main(["--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) >= 15 and {r["phase"] for r in rows} == {"prefill", "decode"}
    assert {(r["tp"], r["ep"]) for r in rows} >= {(1, 1), (2, 1), (1, 2), (2, 2)}
    for r in rows:
        assert 0.2 < r["ratio"] < 1.0, r
    assert "measured / plan" in capsys.readouterr().out


def test_unknown_json_is_a_clear_error(bench_script, tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(SystemExit, match="not a bench/dist.py, e2e.py or decode_graph.py JSON"):
        bench_script("plan_check").main(["--sources", str(bad)])
    with pytest.raises(SystemExit, match="No such file"):
        bench_script("plan_check").main(["--sources", str(tmp_path / "missing.json")])
