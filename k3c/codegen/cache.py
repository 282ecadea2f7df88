"""Content-addressed AOT compile cache (DESIGN.md: key = hash(k3c version, kernel, target, options)).

Layout under `settings().cache_dir` (K3C_CACHE_DIR overrides it):
    aot/<key[:2]>/<key>/entry.json      what compile_kernels needs to rebuild a CompiledKernel without triton
    aot/<key[:2]>/<key>/<files>         the kernel source, binary, assembly, ttgir, triton metadata
    aot/tmp/<pid>-<host>-<random>/      staging: a compile writes here, then one rename publishes the entry

An entry appears only through os.rename of a complete staging directory, so a run killed at any point leaves either
no entry or a whole one. Staging (and trash-) directories name the process that made them: the next compile on the
same host removes those whose process is gone, and any left after a day (another host's, a reused pid). Readers
trust an entry only when entry.json parses and every file it lists is present with the sha256 recorded at publish
time; anything else is removed and treated as a miss (so a tampered binary is compiled again, never copied into an
artifact). A cache directory that cannot be used (open_cache) gives an uncached build and one warning line.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import uuid
from importlib import metadata as _metadata

from ..config import settings
from ..outputs import pid_alive

CACHE_FORMAT = "k3c-aot-cache/3"     # /2: entries record the sha256 of every file, checked on every hit;
                                     # /3: binaries compiled from kernels/<name>.py, comments blanked (no paths)
ENTRY_FILE = "entry.json"
_STALE_TMP_SECONDS = 24 * 3600
_OWNED = re.compile(r"^(?:trash-)?(\d+)-([0-9a-f]{8})-[0-9a-f]{32}$")     # <pid>-<host>-<random>
_WARNED: set[str] = set()


def triton_version() -> str:
    """The installed triton version, read without importing triton (importing it may pick interpreter mode)."""
    try:
        return _metadata.version("triton")
    except _metadata.PackageNotFoundError:
        return "none"


def cache_key(kernel_digest: str, target, options: dict | None = None) -> str:
    """sha256 over (cache format, k3c version, triton version, target name/backend/arch/warp, kernel digest,
    compile options)."""
    from .. import __version__

    parts = {
        "format": CACHE_FORMAT,
        "k3c": __version__,
        "triton": triton_version(),
        "target": [target.name, target.backend, target.arch, target.warp_size],
        "kernel": kernel_digest,
        "options": options or {},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class CompileCache:
    """A directory of published compile results, keyed by `cache_key`."""

    def __init__(self, root: str | None = None):
        self.base = root or settings().cache_dir
        self.root = os.path.join(self.base, "aot")
        self.tmp_root = os.path.join(self.root, "tmp")

    def check(self) -> None:
        """Raise OSError unless staging directories can be made here (K3C_CACHE_DIR a file, /dev/null, a
        read-only directory, a full disk)."""
        os.makedirs(self.tmp_root, exist_ok=True)
        os.rmdir(self.new_staging_dir())

    # ------------------------------------------------------------------------------------------------------ paths
    def entry_dir(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    def new_staging_dir(self) -> str:
        """An empty private directory on the cache's filesystem (so publishing is a rename)."""
        os.makedirs(self.tmp_root, exist_ok=True)
        path = os.path.join(self.tmp_root, _owned_name())
        os.makedirs(path)
        return path

    def sweep(self) -> int:
        """Remove staging / trash directories whose process (on this host) has exited, and any a day old; the
        number removed. compile_kernels calls it once per call."""
        try:
            names = os.listdir(self.tmp_root)
        except OSError:
            return 0
        now, host, removed = time.time(), _host_tag(), 0
        for name in names:
            path = os.path.join(self.tmp_root, name)
            m = _OWNED.match(name)
            try:
                dead = m is not None and m.group(2) == host and not pid_alive(int(m.group(1)))
                if dead or now - os.lstat(path).st_mtime > _STALE_TMP_SECONDS:
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.unlink(path)
                    removed += 1
            except OSError:
                pass
        return removed

    # ------------------------------------------------------------------------------------------------------ lookup
    def lookup(self, key: str) -> dict | None:
        """The entry record (with '_dir' set to the entry directory) or None when absent or damaged."""
        path = self.entry_dir(key)
        entry_file = os.path.join(path, ENTRY_FILE)
        if not os.path.isfile(entry_file):
            return None
        try:
            with open(entry_file) as f:
                entry = json.load(f)
            files = entry.get("files", {})
            sums = entry.get("sha256", {})
            if entry.get("format") != CACHE_FORMAT or entry.get("key") != key or set(sums) != set(files.values()) \
                    or not all(_sha256(os.path.join(path, rel)) == sums[rel] for rel in files.values()):
                raise ValueError("incomplete or changed entry")     # a miss: compiled again
        except (OSError, ValueError, RecursionError):
            self._discard(path)
            return None
        entry["_dir"] = path
        return entry

    def fetch(self, key: str, out_dir: str) -> dict | None:
        """Copy a hit's files into out_dir (same relative paths); the entry record, or None on a miss."""
        entry = self.lookup(key)
        if entry is None:
            return None
        for rel in entry["files"].values():
            dst = os.path.join(out_dir, rel)
            os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
            _atomic_copy(os.path.join(entry["_dir"], rel), dst)
        return entry

    # ------------------------------------------------------------------------------------------------------ store
    def publish(self, key: str, staging_dir: str, entry: dict) -> str:
        """Write entry.json into the staging directory and rename it into place. The staging directory is gone
        afterwards (moved, or removed when another process published the same key first)."""
        record = dict(entry, format=CACHE_FORMAT, key=key, created=time.time(),
                      sha256={rel: _sha256(os.path.join(staging_dir, rel)) for rel in entry["files"].values()})
        with open(os.path.join(staging_dir, ENTRY_FILE), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True, default=str)
        final = self.entry_dir(key)
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
        except (FileExistsError, NotADirectoryError):      # a file where the key's folder goes: not ours
            self._discard(os.path.dirname(final))
            os.makedirs(os.path.dirname(final), exist_ok=True)
        try:
            os.rename(staging_dir, final)
        except OSError:                 # a concurrent run published it, or a damaged entry is in the way
            if self.lookup(key) is None:
                self._discard(final)
                try:
                    os.rename(staging_dir, final)
                    return final
                except OSError:
                    pass
            shutil.rmtree(staging_dir, ignore_errors=True)
        return final

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ---------------------------------------------------------------------------------------------------- helpers
    def _discard(self, path: str) -> None:
        """Move a damaged entry aside first (atomic), then delete it."""
        if not os.path.lexists(path):
            return
        os.makedirs(self.tmp_root, exist_ok=True)
        trash = os.path.join(self.tmp_root, "trash-" + _owned_name())
        try:
            os.rename(path, trash)
        except OSError:
            return
        if os.path.isdir(trash) and not os.path.islink(trash):
            shutil.rmtree(trash, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(trash)



def open_cache(root: str | None = None) -> CompileCache | None:
    """The compile cache, or None when its directory cannot be used (K3C_CACHE_DIR naming a file, /dev/null, a
    read-only directory): the build then runs uncached, after one warning line on stderr (once per directory and
    process)."""
    store = CompileCache(root)
    try:
        store.check()
    except OSError as exc:
        if store.base not in _WARNED:
            _WARNED.add(store.base)
            reason = exc.strerror or type(exc).__name__
            print(f"k3c: warning: cache directory {store.base} is not usable ({reason}); compiling without the "
                  f"cache (set K3C_CACHE_DIR to a writable directory)", file=sys.stderr)
        return None
    return store


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode(errors="replace")).hexdigest()[:8]


def _owned_name() -> str:
    """<pid>-<host>-<random>: a name the next compile can tell is orphaned (its process gone)."""
    return f"{os.getpid()}-{_host_tag()}-{uuid.uuid4().hex}"


def _sha256(path: str) -> str:
    """sha256 hex of a file; '' when it cannot be read (never equal to a recorded digest)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return ""
    return h.hexdigest()


def _atomic_copy(src: str, dst: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dst) or ".", prefix=".k3c-", suffix=".part")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        shutil.copymode(src, tmp)               # mkstemp made it 0600; keep the stored file's mode
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
