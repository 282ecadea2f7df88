"""Compiler worker processes and the compile cache under hostile and careless use (k3c/codegen/aot.py, cache.py).

No worker outlives the process that started it: SIGKILL of the parent (the workers notice and exit), SIGTERM (the
parent kills them and exits 143), and nobody keeps the caller's stdout open. Staging folders of a killed compile
are swept by the next one. An unusable K3C_CACHE_DIR gives an uncached build and one warning; a tampered cache entry
is compiled again. The process tests run a child that compiles through compile_kernels with the worker job swapped
for one that only records its pid and sleeps, so they take seconds; tests/codegen/test_reproducible.py kills real
`k3c compile` runs.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from k3c.codegen import aot, cache
from k3c.codegen.aot import compile_kernels, shutdown_workers
from k3c.codegen.cache import CompileCache
from k3c.codegen.kernel import blank_comments

sys.path.insert(0, str(Path(__file__).parent))
from test_aot import ADD_SRC, add_kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ process helpers
def session_processes(sid: int) -> list[tuple[int, str, str]]:
    """(pid, state, cmdline) of every live process of session `sid` (zombies hold no files and are left out)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) != sid or fields[0] in "ZX":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except (OSError, ValueError):
            continue
        out.append((int(name), fields[0], cmd))
    return out


def wait_session_gone(sid: int, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while True:
        left = session_processes(sid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def read_to_eof(stream, timeout: float) -> tuple[bytes, float | None]:
    """Everything on `stream` and the seconds until EOF (None: still open after `timeout`: someone holds it)."""
    chunks, done = [], threading.Event()
    start = time.monotonic()

    def reader():
        for block in iter(lambda: stream.read1(65536), b""):
            chunks.append(block)
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    ok = done.wait(timeout)
    return b"".join(chunks), (time.monotonic() - start) if ok else None


def kill_session(sid: int) -> None:
    for pid, _state, _cmd in session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


CHILD = '''
import os, sys
sys.path[:0] = [{tests!r}, {here!r}]
from k3c.codegen import aot
import slow_job
from test_aot import add_kernel
aot._compile_worker = slow_job.run
aot.compile_kernels([add_kernel("k3c_slow_a"), add_kernel("k3c_slow_b")], "mi355x", {out!r}, jobs=2,
                    progress=False)
print("compile_kernels returned", flush=True)
'''

SLOW_JOB = '''
import os, sys, time

def run(job):
    """Stands in for aot._compile_worker: says where it runs, writes to the stdio it was given, then sleeps."""
    with open(os.path.join(os.environ["K3C_TEST_PIDS"], str(os.getpid())), "w") as f:
        f.write(str(os.getpgrp()))
    print("worker output", flush=True)
    print("worker error", file=sys.stderr, flush=True)
    time.sleep(120)
    return {"ok": False, "error": "slept"}
'''


@pytest.fixture
def child(tmp_path):
    """start(): a child compiling two kernels in its own session, returned once both workers run the slow job."""
    procs = []

    def start():
        (tmp_path / "slow_job.py").write_text(SLOW_JOB)
        pids = tmp_path / "pids"
        pids.mkdir()
        script = CHILD.format(tests=str(Path(__file__).parent), here=str(tmp_path), out=str(tmp_path / "out"))
        env = dict(os.environ, K3C_CACHE_DIR=str(tmp_path / "cache"), K3C_TEST_PIDS=str(pids),
                   PYTHONPATH=str(ROOT))
        env.pop("TRITON_INTERPRET", None)
        proc = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
        procs.append(proc)
        deadline = time.monotonic() + 60
        while len(os.listdir(pids)) < 2:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the workers did not start within 60 s"
            time.sleep(0.05)
        workers = {int(p): int((pids / p).read_text()) for p in os.listdir(pids)}
        return proc, workers

    yield start
    for proc in procs:                  # never leave anything behind, whatever failed
        kill_session(proc.pid)
        proc.kill()
        proc.wait()


def staging_dirs(tmp_path: Path) -> list[str]:
    tmp = tmp_path / "cache" / "aot" / "tmp"
    return sorted(os.listdir(tmp)) if tmp.is_dir() else []


def test_workers_detach_and_exit_when_the_parent_is_killed(child, tmp_path):
    proc, workers = child()
    for pid, pgid in workers.items():       # each worker leads its own group (its ptxas goes with it)
        assert pgid == pid
    assert len(staging_dirs(tmp_path)) == 2
    os.kill(proc.pid, signal.SIGKILL)
    out, eof = read_to_eof(proc.stdout, 10)
    assert eof is not None and eof < 5, "the caller's stdout is still held open after the compiler was killed"
    assert b"worker output" not in out and b"worker error" not in out       # workers write to /dev/null
    assert proc.wait(5) == -signal.SIGKILL
    left = wait_session_gone(proc.pid, 5)
    assert not left, f"still running 5 s after SIGKILL of the compiler: {left}"
    # the next compile sweeps the dead compile's staging folders (the owner pid is in the name)
    names = staging_dirs(tmp_path)
    assert len(names) == 2 and all(n.startswith(f"{proc.pid}-") for n in names)
    assert CompileCache(str(tmp_path / "cache")).sweep() == 2 and staging_dirs(tmp_path) == []


def test_sigterm_kills_the_workers_cleans_up_and_exits_143(child, tmp_path):
    proc, _workers = child()
    os.kill(proc.pid, signal.SIGTERM)
    out, eof = read_to_eof(proc.stdout, 15)
    assert eof is not None and eof < 10, "stdout still open 15 s after SIGTERM"
    assert proc.wait(5) == 143, out.decode()[-2000:]
    assert b"compile_kernels returned" not in out and b"Traceback" not in out
    left = wait_session_gone(proc.pid, 5)
    assert not left, f"still running after SIGTERM: {left}"
    assert staging_dirs(tmp_path) == []              # removed on the way out, not left for the next sweep


def test_signal_handlers_only_during_the_compile_and_only_where_default():
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    restore = aot._exit_on_signals()
    try:
        assert callable(signal.getsignal(signal.SIGTERM))
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    def mine(signo, frame):
        pass
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        restore = aot._exit_on_signals()
        assert signal.getsignal(signal.SIGTERM) is mine         # a program's own handler is left alone
        restore()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    seen = []                                                  # not the main thread: nothing installed
    thread = threading.Thread(target=lambda: seen.append(aot._exit_on_signals()()))
    thread.start()
    thread.join()
    assert seen == [None] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sweep_removes_only_what_dead_local_processes_left(tmp_path):
    store = CompileCache(str(tmp_path))
    store.check()
    dead = subprocess.Popen(["true"])
    dead.wait()
    host, other_host = cache._host_tag(), "0" * 8 if cache._host_tag() != "0" * 8 else "1" * 8
    rnd = "ab" * 16
    names = {
        f"{dead.pid}-{host}-{rnd}": False,              # its process is gone: swept
        f"trash-{dead.pid}-{host}-{rnd}": False,
        f"{os.getpid()}-{host}-{rnd}": True,            # a live compile's: kept
        f"{dead.pid}-{other_host}-{rnd}": True,         # another host's (shared cache): kept until a day old
        "not-ours": True,
    }
    for name in names:
        os.makedirs(os.path.join(store.tmp_root, name, "kernels"))
    old = os.path.join(store.tmp_root, f"{dead.pid}-{other_host}-{'cd' * 16}")
    os.makedirs(old)
    os.utime(old, (time.time() - 2 * 86400,) * 2)       # a day old: swept whoever owned it
    assert store.sweep() == 3
    assert sorted(os.listdir(store.tmp_root)) == sorted(n for n, keep in names.items() if keep)
    fresh = store.new_staging_dir()
    assert cache._OWNED.match(os.path.basename(fresh)) and os.path.basename(fresh).startswith(f"{os.getpid()}-")


# ------------------------------------------------------------------------------------------------------- the cache
@pytest.fixture(scope="module")
def aot_cpu_env():
    """TRITON_INTERPRET=1 as in the CPU suite (the workers must clear it); one worker pool for the module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
    shutdown_workers()


@pytest.mark.parametrize("kind", ["file", "devnull", "readonly"])
def test_unusable_cache_dir_gives_an_uncached_build_and_one_warning(kind, tmp_path, monkeypatch, capfd,
                                                                    aot_cpu_env):
    if kind == "file":
        bad = tmp_path / "a-file"
        bad.write_text("not a directory")
    elif kind == "devnull":
        bad = Path(os.devnull)
    else:
        if os.geteuid() == 0:
            bad = Path("/proc/self/k3c-cache")          # root writes through mode bits; /proc refuses anyone
        else:
            bad = tmp_path / "ro"
            bad.mkdir()
            bad.chmod(0o555)
    monkeypatch.setenv("K3C_CACHE_DIR", str(bad))
    monkeypatch.setattr(cache, "_WARNED", set())
    out = tmp_path / "out"
    result = compile_kernels([add_kernel()], "mi355x", str(out), progress=False)
    assert not result[0].cache_hit and (out / result[0].binary).read_bytes()[:4] == b"\x7fELF"
    assert os.listdir(out / "kernels") == ["k3c_test_add.py"] and cache.open_cache() is None   # warned once
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "without the cache" in warnings[0], err
    if kind == "file":
        assert bad.read_text() == "not a directory"


def test_tampered_cached_binary_is_compiled_again(tmp_path, monkeypatch, aot_cpu_env):
    monkeypatch.setenv("K3C_CACHE_DIR", str(tmp_path / "cache"))
    first = compile_kernels([add_kernel()], "h200", str(tmp_path / "a"), progress=False)[0]
    good = (tmp_path / "a" / first.binary).read_bytes()
    cached = Path(CompileCache().entry_dir(first.key)) / first.binary
    data = bytearray(cached.read_bytes())
    data[len(data) // 2] ^= 0xFF                            # same size, one byte changed
    cached.write_bytes(bytes(data))
    again = compile_kernels([add_kernel()], "h200", str(tmp_path / "b"), progress=False)[0]
    assert not again.cache_hit and again.key == first.key
    assert (tmp_path / "b" / again.binary).read_bytes() == good       # rebuilt, byte for byte
    assert cached.read_bytes() == good                                 # and the entry is whole again
    assert compile_kernels([add_kernel()], "h200", str(tmp_path / "c"), progress=False)[0].cache_hit


def test_compiled_from_a_fixed_path_and_header_comments_do_not_reach_the_key(tmp_path, monkeypatch,
                                                                              aot_cpu_env):
    """The binary names kernels/<name>.py, never the staging folder under the cache; a kernel whose header names
    another spec location is a cache hit with equal bytes, and the artifact keeps its own source."""
    monkeypatch.setenv("K3C_CACHE_DIR", str(tmp_path / "cache-with-a-long-name"))
    base = add_kernel()
    first = compile_kernels([base], "mi355x", str(tmp_path / "a"), progress=False)[0]
    binary = (tmp_path / "a" / first.binary).read_bytes()
    assert b"cache-with-a-long-name" not in binary and str(tmp_path).encode() not in binary
    assert b"k3c_test_add.py" in binary                     # line info kept, under the artifact's file name
    moved_src = ADD_SRC.format(name="k3c_test_add").replace("# IR op: add", "# IR op: add at /else/renamed.yaml:99")
    moved = dataclasses.replace(base, source=moved_src, loc="renamed.yaml:99")
    assert moved.source != base.source and moved.compile_digest == base.compile_digest
    second = compile_kernels([moved], "mi355x", str(tmp_path / "b"), progress=False)[0]
    assert second.cache_hit and (tmp_path / "b" / second.binary).read_bytes() == binary
    assert (tmp_path / "b" / "kernels" / "k3c_test_add.py").read_text() == moved.source
    changed = dataclasses.replace(base, source=base.source.replace("x + y", "x - y"))
    assert changed.compile_digest != base.compile_digest


def test_blank_comments_keeps_every_line_and_column():
    src = "# header: spec.yaml:3\nimport triton  # why\ns = '#not a comment'\n\ndef f():\n    # body\n    return 1\n"
    out = blank_comments(src)
    assert out == "#\nimport triton  #\ns = '#not a comment'\n\ndef f():\n    #\n    return 1\n"
    assert blank_comments("def broken(:\n  # x\n") in ("def broken(:\n  #\n", "def broken(:\n  # x\n")


def test_cache_key_does_not_depend_on_the_spec_file_name_or_lines(tmp_path):
    from k3c import api

    spec = (ROOT / "examples" / "k3-tiny.yaml").read_text()
    moved = tmp_path / "elsewhere" / "another-name.yaml"
    moved.parent.mkdir()
    moved.write_text("# moved, renamed and reformatted\n\n" + spec)
    a = api.compile(str(ROOT / "examples" / "k3-tiny.yaml"), target="h200")
    b = api.compile(str(moved), target="h200")
    assert any("k3-tiny.yaml" in op.loc for op in a.module.ops)        # the IR still says where ops came from
    assert a.cache_key == b.cache_key
    assert api.compile(str(moved), target="mi355x").cache_key != a.cache_key
