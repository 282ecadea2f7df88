"""The sandbox every hostile case runs in, and the checks made around it.

A case runs `k3c.cli.main(argv)` in this process (an interpreter start per case would cost the suite minutes) with
the sandbox as the working directory. The sandbox holds what a careless user has lying around: a project folder
with a spec and notes, a compiled artifact, weights, router scores. Around each case:

- a snapshot of every path in the sandbox (type, size, content hash; symlinks not followed) before and after: what
  changed must lie inside the outputs the case names;
- no k3c staging or set-aside folder (.k3c-tmp-*, .k3c-old-*, *.tmp-*) is left anywhere in the sandbox;
- the exit code is the expected one (0 or 2); an exit 2 prints exactly one line on stderr, naming what the case
  says it must name; nothing prints a traceback;
- a case is bounded: SIGALRM after its time limit raises CaseTimeout, which k3c's handlers do not swallow.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "k3-tiny.yaml"
STAGING_MARKS = (".k3c-tmp-", ".k3c-old-", ".tmp-")


class CaseTimeout(BaseException):
    """Raised by SIGALRM: a BaseException so that no `except Exception` inside k3c turns it into an exit code."""


@dataclass(frozen=True)
class Case:
    """One hostile or careless use. argv may hold {repo} and {tiny}; paths are relative to the sandbox."""

    name: str
    argv: tuple[str, ...]
    expect: tuple[int, ...] = (2,)
    mentions: tuple[str, ...] = ()           # substrings of the one error line (the file, field or argument)
    setup: Callable[[Path], None] | None = None
    outputs: tuple[str, ...] = ()            # sandbox paths the case may create or change
    env: tuple[tuple[str, str], ...] = ()
    seconds: int = 60
    cls: str = "misc"                        # the class of mistake, for the counts in the closing note
    check: Callable[[Path], None] | None = field(default=None)   # extra assertions on the sandbox after the run


def reseal_manifest(art: Path) -> None:
    """The artifact's manifest sha256 list recomputed (a forger who knows the format): the hash cannot catch what
    was changed, another check must."""
    import json

    manifest = json.loads((art / "manifest.json").read_text())
    listed = {}
    for dirpath, _dirs, files in os.walk(art):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), art)
            if rel != "manifest.json":
                with open(os.path.join(dirpath, f), "rb") as fh:
                    listed[rel] = hashlib.sha256(fh.read()).hexdigest()
    manifest["sha256"] = dict(sorted(listed.items()))
    (art / "manifest.json").write_text(json.dumps(manifest))


def snapshot(root: Path) -> dict[str, tuple]:
    """relative path -> (kind, size, sha256 or link target); nothing followed, nothing outside root read."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            elif stat.S_ISREG(st.st_mode):
                with open(full, "rb") as fh:
                    out[rel] = ("file", st.st_size, hashlib.sha256(fh.read()).hexdigest())
            else:
                out[rel] = ("special", stat.S_IFMT(st.st_mode))
    return out


def changed_outside(before: dict, after: dict, outputs: tuple[str, ...]) -> list[str]:
    def inside(rel: str) -> bool:
        return any(rel == o or rel.startswith(o.rstrip("/") + os.sep) for o in outputs)

    keys = set(before) | set(after)
    return sorted(k for k in keys if before.get(k) != after.get(k) and not inside(k))


def leftovers(root: Path) -> list[str]:
    out = []
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            if any(mark in name for mark in STAGING_MARKS):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return out


@dataclass
class Outcome:
    rc: int
    stdout: str
    stderr: str


def _fifos(root: str) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        out += [os.path.join(dirpath, f) for f in files if stat.S_ISFIFO(os.lstat(os.path.join(dirpath, f)).st_mode)]
    return out


def run_cli(argv: list[str], seconds: int) -> Outcome:
    """k3c.cli.main(argv) in this process, bounded: after `seconds` SIGALRM raises CaseTimeout (the case fails
    with rc -1). A read blocked on a FIFO inside C code that holds the GIL (safetensors' Rust) would never reach
    the handler, so a shell opens and closes every FIFO of the sandbox for writing at the deadline: the reader
    sees end-of-file and returns."""
    import subprocess

    from k3c.cli import main

    def on_alarm(signum, frame):
        raise CaseTimeout(f"no answer within {seconds} s")

    out, err = io.StringIO(), io.StringIO()
    fifos = _fifos(os.getcwd())
    unblocker = subprocess.Popen(["sh", "-c", f'sleep {seconds}; for f in "$@"; do exec 3<>"$f"; exec 3>&-; done',
                                  "sh", *fifos]) if fifos else None
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except CaseTimeout as exc:                   # reported as an ordinary failure (pytest stops on a BaseException)
        return Outcome(rc=-1, stdout=out.getvalue(), stderr=err.getvalue() + f"[{exc}]")
    finally:
        if unblocker is not None:
            unblocker.kill()
            unblocker.wait()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if time.monotonic() - t0 >= seconds:         # answered only once its FIFOs were unblocked: it hung
        return Outcome(rc=-1, stdout=out.getvalue(), stderr=err.getvalue() + f"[blocked for {seconds} s]")
    return Outcome(rc=rc, stdout=out.getvalue(), stderr=err.getvalue())
