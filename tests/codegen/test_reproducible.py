"""Reproducible builds, and `k3c compile` killed in the middle of its kernel compile.

One module fixture runs, in subprocesses of their own sessions (everything bounded by timeouts):
  1. a clean compile of examples/k3-tiny.yaml for mi355x with K3C_CACHE_DIR=/dev/null (an unusable cache: an
     uncached build, exit 0, one warning line);
  2. the same spec into another directory with a fresh K3C_CACHE_DIR, SIGTERMed at a random moment of its kernel
     compile;
  3. the same again, SIGKILLed (the orphaned compiler workers must exit by themselves);
  4. the same again, to the end: it sweeps what the kills left, finds part of its kernels in the cache, and must
     give an artifact byte-identical to the clean one, file by file (manifest and report included).
A renamed or moved spec is a cache hit with the same binaries (tests/codegen/test_compile_processes.py,
test_aot.py); its artifact differs only where it names the spec (the IR's and kernels' `loc`).
About two full AOT compiles of k3-tiny: over 60 s (roughly 3 minutes on a busy 2-core machine).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_compile_processes import kill_session, read_to_eof, wait_session_gone  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SPEC = "examples/k3-tiny.yaml"
TARGET = "mi355x"
COMPILE_TIMEOUT = 420


def start_compile(spec: str, out: Path, cache: str) -> subprocess.Popen:
    env = dict(os.environ, K3C_CACHE_DIR=cache, PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.Popen([sys.executable, "-m", "k3c.cli", "compile", spec, "--target", TARGET, "-o", str(out)],
                            cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"k3c compile did not finish in {COMPILE_TIMEOUT} s: {err.decode()[-2000:]}")
    return proc.returncode, out.decode(), err.decode()


def staging(cache: Path) -> list[str]:
    tmp = cache / "aot" / "tmp"
    return sorted(os.listdir(tmp)) if tmp.is_dir() else []


def leftovers(out_parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(out_parent) if n.startswith(".k3c-"))


def killed_compile(spec: str, out: Path, cache: Path, sig: int, rng: random.Random) -> dict:
    """Start a compile, wait until its kernel compile runs (staging folders appear), send `sig` after a random
    delay; what happened."""
    before = set(staging(cache))
    proc = start_compile(spec, out, str(cache))
    try:
        deadline = time.monotonic() + 180
        while not set(staging(cache)) - before:
            if proc.poll() is not None:
                pytest.fail(f"k3c compile ended before its kernel compile: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no kernel compile started within 180 s")
            time.sleep(0.05)
        delay = rng.uniform(0.2, 4.0)
        time.sleep(delay)
        running = len(wait_session_gone(proc.pid, 0))
        os.kill(proc.pid, sig)
        t0 = time.monotonic()
        err_holder = {}
        reader = threading.Thread(target=lambda: err_holder.update(err=read_to_eof(proc.stderr, 20)), daemon=True)
        reader.start()
        _, eof = read_to_eof(proc.stdout, 20)
        reader.join(25)
        rc = proc.wait(10)
        left = wait_session_gone(proc.pid, 10)
        return {"rc": rc, "stdout_eof": eof, "stderr": err_holder.get("err", (b"", None))[0].decode(),
                "stderr_eof": err_holder.get("err", (b"", None))[1], "left": left,
                "gone_after": time.monotonic() - t0, "delay": delay, "processes_before": running,
                "staging": staging(cache), "leftovers": leftovers(out.parent)}
    finally:
        kill_session(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    rng = random.Random()
    clean_out = root / "clean" / "art"
    clean_out.parent.mkdir()
    rc, _out, err = finish(start_compile(SPEC, clean_out, os.devnull))
    assert rc == 0, err[-3000:]
    clean = {"rc": rc, "stderr": err}

    cache = root / "cache"
    out = root / "resumed" / "art"
    out.parent.mkdir()
    term = killed_compile(SPEC, out, cache, signal.SIGTERM, rng)
    kill = killed_compile(SPEC, out, cache, signal.SIGKILL, rng)
    rc, _out, err = finish(start_compile(SPEC, out, str(cache)))
    assert rc == 0, err[-3000:]
    resumed = {"rc": rc, "stderr": err, "staging": staging(cache), "leftovers": leftovers(out.parent)}
    return {"clean": clean, "clean_dir": clean_out, "term": term, "kill": kill, "resumed": resumed,
            "dir": out}


def test_unusable_cache_dir_builds_uncached_with_one_warning(runs):
    err = runs["clean"]["stderr"]
    warnings = [line for line in err.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1 and os.devnull in warnings[0] and "without the cache" in warnings[0], err[-2000:]


def test_sigterm_during_the_kernel_compile(runs):
    t = runs["term"]
    info = f"(SIGTERM {t['delay']:.1f} s into the kernel compile: {t})"
    assert t["rc"] == 128 + signal.SIGTERM, info
    assert t["stdout_eof"] is not None and t["stdout_eof"] < 10, info        # nobody holds the caller's pipes
    assert t["stderr_eof"] is not None and t["stderr_eof"] < 10, info
    assert not t["left"], info
    assert t["staging"] == [] and t["leftovers"] == [], info                  # cleaned on the way out
    assert "Traceback" not in t["stderr"], info


def test_sigkill_during_the_kernel_compile(runs):
    k = runs["kill"]
    info = f"(SIGKILL {k['delay']:.1f} s into the kernel compile: {k})"
    assert k["rc"] == -signal.SIGKILL, info
    assert k["stdout_eof"] is not None and k["stdout_eof"] < 5, info
    assert not k["left"], info                          # the orphaned workers and the resource tracker exited


def test_next_compile_sweeps_what_the_killed_ones_left(runs):
    r = runs["resumed"]
    assert r["staging"] == [] and r["leftovers"] == [], r
    assert "warning" not in r["stderr"].lower(), r["stderr"][-2000:]


def test_artifacts_are_byte_identical_to_a_clean_compile(runs):
    """Same spec, another output directory, another cache, two kills on the way: every file of the artifact equal
    (binaries, metadata, assembly, ttgir, kernel sources, IR, report, manifest); no cache or output path inside."""
    a, b = runs["clean_dir"], runs["dir"]
    names_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    assert names_a == names_b
    assert sum(n.endswith(".hsaco") for n in names_a) > 50
    differ = [n for n in names_a if (a / n).read_bytes() != (b / n).read_bytes()]
    if "manifest.json" in differ:                   # say which entries differ
        ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
        keys = [k for k in ma if ma[k] != mb.get(k)]
        kernels = [(x["name"], [f for f in x if x[f] != y.get(f)]) for x, y in zip(ma["kernels"], mb["kernels"])
                   if x != y]
        import difflib

        diff = list(difflib.unified_diff((a / "manifest.json").read_text().splitlines(),
                                         (b / "manifest.json").read_text().splitlines(), lineterm="", n=1))
        pytest.fail(f"manifest.json differs in {keys}; kernels {kernels[:3]}; {diff[:12]}")
    assert differ == [], f"{len(differ)} files differ, e.g. {differ[:5]}"
    for n in names_b:
        data = (b / n).read_bytes()
        assert b"/aot/tmp/" not in data and str(runs["dir"].parent.parent).encode() not in data, n
