"""bench/plan_check.py over the checked-in H200 measurements: `k3c plan`'s roofline must bound every measured
tokens/s from above (a plan below a measurement is a wrong plan: it caught TP 2 x EP 1 being charged every expert
as a dense linear), and the code reaches a plausible share of it."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mod():
    spec = importlib.util.spec_from_file_location("bench_plan_check", os.path.join(ROOT, "bench", "plan_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_plan_bounds_every_measurement(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert _mod().main(["--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) >= 15 and {r["phase"] for r in rows} == {"prefill", "decode"}
    assert {(r["tp"], r["ep"]) for r in rows} >= {(1, 1), (2, 1), (1, 2), (2, 2)}
    for r in rows:
        assert 0.2 < r["ratio"] < 1.0, r
    assert "measured / plan" in capsys.readouterr().out


def test_unknown_json_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(SystemExit, match="not a bench/dist.py, e2e.py or decode_graph.py JSON"):
        _mod().main(["--sources", str(bad)])
    with pytest.raises(SystemExit, match="No such file"):
        _mod().main(["--sources", str(tmp_path / "missing.json")])
