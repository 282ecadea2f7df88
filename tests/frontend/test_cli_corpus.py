"""The CLI on bad specs: exit 2, exactly one stderr line naming the file, no traceback, nothing half-written.

Skipped only while k3c/cli.py does not exist; it activates by itself when the CLI lands.
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import BAD_SPECS, REPO


SAMPLE = [
    "syntax_tab_indent.yaml",
    "key_model_misspelled.yaml",
    "enum_gate_sfae.yaml",
    "tag_python_os_system.yaml",
    "alias_billion_laughs.yaml",
    "binary_png.yaml",
    "layers_overlap.yaml",
    "empty.yaml",
    "key_with_newline.yaml",
    "yaml11_octal_hidden_size.yaml",
    "hf_text_config_null.json",
]


def _k3c(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("K3C_DEBUG", None)                       # tracebacks only come with K3C_DEBUG
    return subprocess.run([sys.executable, "-m", "k3c.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _assert_bad_spec_exit(proc: subprocess.CompletedProcess, path: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert path in lines[0]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    return lines[0]


@pytest.fixture(scope="module")
def inspect_runs() -> dict[str, subprocess.CompletedProcess]:
    """`k3c inspect` on every sampled file, a few processes at a time (interpreter start-up dominates)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = {name: pool.submit(_k3c, "inspect", str(BAD_SPECS / name)) for name in SAMPLE}
        return {name: run.result() for name, run in runs.items()}


@pytest.mark.parametrize("name", SAMPLE)
def test_inspect_bad_spec(inspect_runs, name):
    _assert_bad_spec_exit(inspect_runs[name], str(BAD_SPECS / name))


def test_inspect_missing_file_and_directory(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    _assert_bad_spec_exit(_k3c("inspect", missing), missing)
    _assert_bad_spec_exit(_k3c("inspect", str(tmp_path)), str(tmp_path))


@pytest.mark.parametrize("name", ["key_model_misspelled.yaml", "syntax_unclosed_quote.yaml", "binary_random.yaml"])
def test_compile_bad_spec_leaves_no_output(tmp_path, name):
    out_root = tmp_path / "out"
    out_root.mkdir()
    out_dir = out_root / "model"
    path = str(BAD_SPECS / name)
    _assert_bad_spec_exit(_k3c("compile", path, "--target", "mi355x", "-o", str(out_dir)), path)
    assert not out_dir.exists()
    assert list(out_root.iterdir()) == [], "compile left files behind"
