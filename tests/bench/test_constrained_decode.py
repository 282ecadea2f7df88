"""bench/constrained_decode.py in its small mode (CPU, fp32, kernels off, k3-tiny with the synthetic vocabulary):
both rows are there, every constrained request decoded its full length under its grammar, the mask time was
measured, and the JSON holds what the table printed."""
import json
import os
import sys

import pytest

pytest.importorskip("xgrammar")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

import constrained_decode  # noqa: E402


def test_small_run(tmp_path, capsys):
    out = tmp_path / "cd.json"
    assert constrained_decode.main(["--device", "cpu", "--no-kernels", "--small", "--models", "wide",
                                    "--wide", "examples/k3-tiny.yaml", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["config"]) for r in rows] == [("wide", "unconstrained"), ("wide", "json_schema")]
    free, constrained = rows
    assert free["host_mask_ms_per_step"] == 0 and constrained["host_mask_ms_per_step"] > 0
    assert constrained["grammar_failures"] == 0
    for r in rows:
        assert r["decode_tokens_per_s"] > 0 and r["batch"] == 4
    assert constrained["vs_unconstrained"] == pytest.approx(
        constrained["decode_tokens_per_s"] / free["decode_tokens_per_s"], rel=1e-3)
    printed = capsys.readouterr().out
    assert "json_schema" in printed and "unconstrained" in printed


def test_synthetic_vocabulary_is_distinct_byte_level_text():
    vocab = constrained_decode.synthetic_vocab(20000)
    assert len(vocab) == len(set(vocab)) == 20000
    assert any(v.startswith("Ġ") for v in vocab[4096:])      # words with a leading space, byte-level spelled
    assert not any(" " in v for v in vocab[4096:])
