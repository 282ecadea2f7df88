"""README.md is true as a new user meets it: the Quickstart's k3c commands, then every command of the Use section,
run as written by bash in a fresh directory holding the checkout's examples/ and k3c/ (the files the commands name),
each exiting 0; the server the Use section starts in the background answers the README's curl command and Python
client, and stops on SIGINT. A `k3c` on PATH runs this checkout's package (`python -m k3c.cli`)."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else len(README)]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def quickstart_commands() -> list[str]:
    """The main job's k3c commands (the pip installs before them are the environment this test runs in)."""
    line = _blocks(_section("Quickstart"), "bash")[0].strip()
    return [c.strip() for c in line.split("&&") if c.strip().startswith("k3c ")]


def use_commands() -> list[str]:
    return [line for line in _blocks(_section("Use"), "bash")[0].splitlines() if line.strip()]


def test_every_use_command_is_a_k3c_command():
    cmds = use_commands()
    assert len(cmds) >= 12
    for c in cmds:
        assert re.match(r"^(echo .* \| )?k3c ", c), c
    assert quickstart_commands()[0].startswith("k3c compile") and quickstart_commands()[-1].startswith("k3c run")


@pytest.fixture
def user_dir(tmp_path):
    """A fresh directory as the README's commands see the checkout, with `k3c` on PATH."""
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("examples", "k3c"):
        (work / name).symlink_to(ROOT / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "k3c"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m k3c.cli \"$@\"\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "K3C_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    return work, env


def _bash(cmd: str, work, env, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _serve(cmd: str, work, env) -> None:
    """The Use section's `k3c serve ... &`: started, asked the README's curl command and Python client, stopped.
    Port 8000 as written when it is free here; otherwise a free port, put into all three alike."""
    cmd = cmd.split("#")[0].strip().rstrip("&").strip()
    port = "8000"
    if not _port_free(8000):
        cmd = cmd.replace("--port 8000", "--port 0")
    proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        line = ""
        while "listening on" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline
        port = re.search(r":(\d+) ", line).group(1)
        section = _section("Use")
        if shutil.which("curl"):
            curl = _blocks(section, "bash")[1].replace("8000", port)
            r = _bash(curl, work, env, 120)
            assert r.returncode == 0 and '"text"' in r.stdout, (r.stdout, r.stderr)
        client = _blocks(section, "python")[1].replace("8000", port)
        r = subprocess.run([sys.executable, "-c", client], cwd=work, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
        tool_call = _blocks(section, "python")[2].replace("8000", port)
        r = subprocess.run([sys.executable, "-c", tool_call], cwd=work, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and r.stdout.startswith("functions.get_weather:0 get_weather {"), r.stderr[-3000:]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "stopped" in out, err[-2000:]


@pytest.mark.slow
def test_quickstart_then_every_use_command_runs_as_written(user_dir):
    pytest.importorskip("matplotlib")                   # the Quickstart installs the [plot] extra
    work, env = user_dir
    for cmd in quickstart_commands() + use_commands():
        if cmd.split("#")[0].strip().endswith("&"):
            _serve(cmd, work, env)
            continue
        r = _bash(cmd, work, env)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-3000:])
        assert "Traceback" not in r.stderr and "error" not in r.stderr.lower(), (cmd, r.stderr[-3000:])
    assert (work / "out" / "k3-stdlib" / "manifest.json").is_file()
    assert sorted(os.listdir(work / "out" / "ir-dumps"))[0].startswith("000_")
    assert (work / "plan.png").stat().st_size > 0
    assert (work / "out" / "bias.safetensors").is_file()
