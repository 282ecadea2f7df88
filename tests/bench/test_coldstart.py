"""bench/coldstart.py on a CPU: the report parser, the references' JSON readers, the targets and the table, and main()
end to end with the GPU processes stood in for (the real run is one H200's)."""
import json
import subprocess

GPU_REPORT = "\n".join([
    'k3c run: k3-wide (8 layers: 6 KDA, 2 MLA) on cuda, bfloat16, weights: random (seed 0)',
    '  executor:        torch.fx graph from the IR after 9 passes: 8 extern, 171 kernel',
    '  batch x prompt:  8 x 1024, new tokens: 64',
    '  weights:         1.84 s (random, seed 0, drawn on cuda; 0.92 s of it preparing them for the graph)',
    '  model:           0.31 s (artifact out/k3-wide-h200 loaded, target h200)',
    '  engine build:    2.05 s (graph, kernels bound, MLA page pool; kernel policy artifact)',
    '  warm-up:         1.62 s (untimed pass of the same requests: prefill 8 x 1024, 63 decode steps;'
    ' JIT, CUDA graph capture; its TTFT 702.5 ms)',
    "  cold TTFT:       3,062.5 ms (model + engine build + the first pass's prefill; weights excluded)",
    '  TTFT:            338.2 ms (timed pass, warm-up excluded)',
    '  prefill:         24,222.3 tokens/s (8 x 1024 tokens / TTFT; timed pass, warm-up excluded)',
    '  decode:          901.5 tokens/s (504 tokens in 63 steps after the first token; timed pass,'
    ' warm-up excluded)',
    "  kernels:         58 from the artifact's binaries (load 0.04 s), 0 JIT-compiled (0.00 s), 0 in the"
    ' interpreter (distinct kernels, whole run); 23,456 launches; timed pass: 0 new JIT, 0 new binaries',
    '  peak memory:     42,000.5 MiB',
    '  MLA cache:       136 pages of 64 tokens (68.0 MiB)',
    '  MLA modes:       layer 3 mha x1, layer 3 mqa x63 (timed pass)',
    '  decode graphs:   63 of 63 decode steps replayed; batch 8: graph (timed pass)',
    '  logits finite:   True',
    '  tokens[0]:       [1, 2, 3]',
    '',
])


def test_parse_report(bench_script):
    got = bench_script("coldstart").parse_report(GPU_REPORT)
    assert got["weights_s"] == 1.84 and got["model_s"] == 0.31 and got["engine_s"] == 2.05
    assert got["warmup_s"] == 1.62 and not got["warmup_skipped"]
    assert abs(got["cold_ttft_s"] - 3.0625) < 1e-12 and got["ttft_ms"] == 338.2
    assert got["prefill_tok_s"] == 24222.3 and got["decode_tok_s"] == 901.5 and got["peak_mib"] == 42000.5
    assert got["kernels"] == {"binaries": 58, "load_s": 0.04, "jit": 0, "jit_s": 0.0, "interpreted": 0,
                              "launches": 23456, "timed_new_jit": 0, "timed_new_binaries": 0}
    assert got["model_source"] == "artifact out/k3-wide-h200 loaded, target h200"
    empty = bench_script("coldstart").parse_report("k3c: error: no such file")
    assert empty["ttft_ms"] is None and empty["kernels"] is None


def test_reference_rates_and_checks(bench_script):
    cs = bench_script("coldstart")
    e2e = {"prefill": {"tokens": 8192, "k3c_ms": 331.2}, "decode": [{"batch": 1, "k3c_ms_per_step": 5.0},
                                                                   {"batch": 8, "k3c_ms_per_step": 8.727}]}
    got = cs.e2e_rates(e2e, 8)
    assert abs(got["prefill_tok_s"] - 8192 / 0.3312) < 1e-6 and abs(got["decode_tok_s"] - 8 / 8.727e-3) < 1e-6
    assert cs.e2e_rates(None, 8) == {"prefill_tok_s": None, "decode_tok_s": None}
    assert cs.dist_rates({"layouts": [{"ranks": [{"prefill_tok_s": 1.0, "decode_tok_s": 2.0}]}]}) == \
        {"prefill_tok_s": 1.0, "decode_tok_s": 2.0}
    assert cs.dist_rates({"layouts": [{"error": "oom"}]})["prefill_tok_s"] is None
    run = {**cs.parse_report(GPU_REPORT), "rc": 0, "wall_s": 12.0}
    chk = cs.checks(run, {"prefill_tok_s": 24731.0, "decode_tok_s": 1100.0})
    assert chk["wall_s"]["passed"] and not chk["cold_ttft_s"]["passed"] and chk["jit"]["passed"]
    assert chk["prefill_tok_s_vs_ref"]["passed"] and not chk["decode_tok_s_vs_ref"]["passed"]   # 0.98, 0.82
    assert cs.checks(run, None)["prefill_tok_s_vs_ref"]["passed"] is None
    assert all(c["passed"] is None for c in cs.checks({**run, "rc": 1}, None).values())


def test_main_with_stand_in_processes(bench_script, tmp_path, monkeypatch, capsys):
    """main(): one fresh process per mode (here stood in), each with empty caches, the JSON and the table."""
    cs = bench_script("coldstart")
    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text("{}")
    seen = []

    def fake_run(cmd, capture_output, text, cwd, env=None, timeout=None):
        seen.append((cmd, env))
        report = GPU_REPORT if "--jit" not in cmd else GPU_REPORT.replace(
            "0 JIT-compiled (0.00 s)", "57 JIT-compiled (80.00 s)").replace("58 from", "1 from")
        return subprocess.CompletedProcess(cmd, 0, stdout=report, stderr="")

    monkeypatch.setattr(cs.subprocess, "run", fake_run)
    out = tmp_path / "cs.json"
    assert cs.main(["--artifact", str(art), "--out", str(out)]) == 0
    assert [c[-1] for c, _ in seen] == ["64", "--jit"]
    assert seen[0][0][3:5] == ["run", str(art)] and "--device" in seen[0][0]
    assert seen[0][1]["TRITON_CACHE_DIR"] != seen[1][1]["TRITON_CACHE_DIR"]        # a fresh cache per process
    rep = json.loads(out.read_text())
    assert [r["mode"] for r in rep["runs"]] == ["artifact", "jit"]
    assert rep["runs"][1]["kernels"]["jit"] == 57 and rep["checks"]["jit"]["jit"]["passed"] is False
    assert rep["compile"] is None
    text = capsys.readouterr().out
    assert "| kernels JIT-compiled | 0 | 57 |" in text and "targets (artifact):" in text
