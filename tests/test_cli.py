"""The CLI: exit codes, one-line errors, artifacts (its kimi-k3 compile with IR dumps is checked in
tests/codegen/test_artifact_kernels.py)."""
import subprocess
import sys

import pytest

from k3c.cli import main
from k3c.ir import parse_module


def run_cli(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "k3c.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_bad_target_lists_valid_ones(tmp_path, capsys):
    code = main(["compile", "examples/k3-tiny.yaml", "--target", "mi999", "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "unknown target 'mi999'" in err and "mi355x" in err and "h200" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, needle", [
    (["compile", "examples/k3-tiny.yaml", "-o", "x"], "--target"),
    (["frobnicate"], "invalid choice"),
    ([], "give a command"),
    (["run", "examples/k3-tiny.yaml", "--batch", "0"], "--batch must be >= 1"),
    (["inspect", "examples/k3-tiny.yaml", "--after", "nope"], "no stage named 'nope'"),
    (["inspect", "examples/k3-tiny.yaml", "--passes", "dce,bogus"], "bogus"),
    (["inspect", "examples/k3-tiny.yaml", "--format", "onnx"], "-o FILE"),
])
def test_bad_arguments_exit_2_one_line(argv, needle, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_bad_spec_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel:\n  hidden_size: 64\n  vocab_sise: 10\n")
    code, stdout, stderr = run_cli("compile", str(bad), "--target", "mi355x", "-o", str(tmp_path / "o"))
    assert code == 2 and "Traceback" not in stderr and stderr.count("\n") == 1
    assert f"{bad}:4" in stderr and "vocab_sise" in stderr and "did you mean 'vocab_size'" in stderr
    assert not (tmp_path / "o").exists()


def test_inspect_formats(tmp_path, capsys):
    assert main(["inspect", "examples/k3-tiny.yaml", "--after", "frontend"]) == 0
    text = capsys.readouterr().out
    assert parse_module(text).name == "k3-tiny"
    assert main(["inspect", "examples/k3-tiny.yaml", "--format", "dot"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("digraph")
    onnx_path = tmp_path / "m.onnx"
    assert main(["inspect", "examples/k3-tiny.yaml", "--format", "onnx", "-o", str(onnx_path)]) == 0
    import onnx

    onnx.checker.check_model(onnx.load(str(onnx_path)))


def test_run_prints_report(capsys):
    assert main(["run", "examples/k3-tiny.yaml", "--batch", "2", "--prompt-len", "12", "--new-tokens", "3",
                 "--interpret"]) == 0
    out = capsys.readouterr().out
    for key in ("TTFT", "prefill:", "decode:", "peak memory", "logits finite:   True", "in the interpreter"):
        assert key in out


def test_compile_then_run_artifact(tmp_path, capsys):
    art = tmp_path / "tiny"
    assert main(["compile", "examples/k3-tiny.yaml", "--target", "h200", "-o", str(art)]) == 0
    assert main(["run", str(art), "--prompt-len", "5", "--new-tokens", "2", "--interpret"]) == 0
    assert "k3-tiny" in capsys.readouterr().out
