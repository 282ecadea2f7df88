"""`k3c plan`: the Done-when command, JSON output, the plot, measured points, exit codes."""
import json

import pytest

from k3c.cli import main

from .conftest import K3, TINY

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_done_when_command_prints_report_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    code = main(["plan", K3, "--target", "mi355x", "--tp", "8", "--context", "1048576", "--kv-dtype", "fp8",
                 "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    for needle in ("k3c plan: kimi-k3 on mi355x", "1. Weights", "2. Memory per GPU", "3. Cost per GPU",
                   "4. KV throughput", "5. MLA MHA vs MQA", "6. MoE communication", "7. AttnRes pipeline",
                   "Assumptions", "1,446.46 GB", "replicated on every TP rank", f"plot: {png}"):
        assert needle in out, needle
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert 10_000 < png.stat().st_size < 400_000


def test_json_output(capsys):
    assert main(["plan", TINY, "--target", "cpu", "--json", "--context", "2048", "--batch", "3"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["context"] == 2048 and d["batch"] == 3 and d["kv_dtype"] == "bf16"
    assert {"weights_bytes", "mla_kv_cache_bytes", "kda_state_bytes", "conv_state_bytes", "attnres_bytes",
            "workspace_bytes", "total_bytes"} <= set(d["per_gpu"])
    assert d["weights_total_bytes"] > d["routed_expert_bytes"] > 0


def test_measured_points(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([
        {"name": "kda_chunk_fwd T=8192", "flops": 2.0e13, "bytes": 4.0e10, "seconds": 2.62e-3, "kind": "kda"},
        {"name": "mla_decode B=32", "flops": 1.0e8, "bytes": 3.0e8, "seconds": 4.5e-4}]))
    assert main(["plan", TINY, "--target", "h200", "--measured", str(bench), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["measured"]
    assert [r["name"] for r in rows] == ["kda_chunk_fwd T=8192", "mla_decode B=32"]
    assert rows[0]["intensity"] == pytest.approx(500.0)
    assert rows[1]["fraction_of_roofline"] == pytest.approx((1e8 / 4.5e-4) / (1 / 3 * 4.8e12))
    assert main(["plan", TINY, "--target", "h200", "--measured", str(bench)]) == 0
    assert "8. Measured points" in capsys.readouterr().out
    # the object form {"records": [...]} reads the same
    bench.write_text(json.dumps({"device": "H200", "records": [{"name": "x", "flops": 1, "bytes": 1,
                                                                 "seconds": 1}]}))
    assert main(["plan", TINY, "--target", "h200", "--measured", str(bench), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured"][0]["name"] == "x"


def test_plot_with_measured_points(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([{"name": "gemm", "flops": 1e12, "bytes": 1e9, "seconds": 1e-3}]))
    png = tmp_path / "tiny.png"
    assert main(["plan", TINY, "--target", "cpu", "--plot", str(png), "--measured", str(bench), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(png)
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("argv, needle", [
    (["plan", TINY], "--target"),
    (["plan", TINY, "--target", "mi999"], "unknown target 'mi999'"),
    (["plan", TINY, "--target", "cpu", "--tp", "0"], "--tp must be >= 1"),
    (["plan", TINY, "--target", "cpu", "--context", "abc"], "--context must be an integer"),
    (["plan", TINY, "--target", "cpu", "--kv-dtype", "fp16"], "invalid choice"),
    (["plan", TINY, "--target", "cpu", "--tp", "8", "--ep", "3"], "one must divide the other"),
    (["plan", TINY, "--target", "cpu", "--headroom", "1.5"], "--headroom"),
    (["plan", TINY, "--target", "cpu", "--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["plan", TINY, "--target", "cpu", "--measured", "/nonexistent/bench.json"], "--measured"),
    (["plan", "/nonexistent/spec.yaml", "--target", "cpu"], "spec.yaml"),
])
def test_bad_arguments_exit_2_one_line(argv, needle, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    ('{"name": "x"}', "expected a list"),
    ('[{"name": "x", "flops": 1, "bytes": 1}]', "missing seconds"),
    ('[{"name": "x", "flops": 1, "bytes": 1, "seconds": 0}]', "'seconds' must be a positive number"),
    ('[{"name": "x", "flops": "1", "bytes": 1, "seconds": 1}]', "'flops' must be a positive number"),
    ('[7]', "expected an object"),
])
def test_bad_measured_file_exits_2(tmp_path, content, needle, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(content)
    code = main(["plan", TINY, "--target", "cpu", "--measured", str(bench)])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1


def test_unwritable_plot_path_exits_2(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code = main(["plan", TINY, "--target", "cpu", "--plot", str(tmp_path / "no" / "dir" / "p.png")])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
