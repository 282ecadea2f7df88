"""Content-addressed AOT compile cache (DESIGN.md: key = hash(k3c version, kernel, target, options)).

Layout under `settings().cache_dir` (K3C_CACHE_DIR overrides it):
    aot/<key[:2]>/<key>/entry.json      what compile_kernels needs to rebuild a CompiledKernel without triton
    aot/<key[:2]>/<key>/<files>         the kernel source, binary, assembly, ttgir, triton metadata
    aot/tmp/<random>/                   staging: a compile writes here, then one rename publishes the entry

An entry appears only through os.rename of a complete staging directory, so a run killed at any point leaves either
no entry or a whole one (stale staging directories are swept after a day). Readers trust an entry only when
entry.json parses and every file it lists is present with the sha256 recorded at publish time; anything else is
removed and treated as a miss (so a tampered binary is compiled again, never copied into an artifact).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from importlib import metadata as _metadata

from ..config import settings

CACHE_FORMAT = "k3c-aot-cache/2"     # /2: entries record the sha256 of every file, checked on every hit
ENTRY_FILE = "entry.json"
_STALE_TMP_SECONDS = 24 * 3600


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
        self.root = os.path.join(root or settings().cache_dir, "aot")
        self.tmp_root = os.path.join(self.root, "tmp")

    # ------------------------------------------------------------------------------------------------------ paths
    def entry_dir(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    def new_staging_dir(self) -> str:
        """An empty private directory on the cache's filesystem (so publishing is a rename)."""
        os.makedirs(self.tmp_root, exist_ok=True)
        self._sweep_stale()
        path = os.path.join(self.tmp_root, uuid.uuid4().hex)
        os.makedirs(path)
        return path

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
        except (OSError, ValueError):
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
        if not os.path.exists(path):
            return
        os.makedirs(self.tmp_root, exist_ok=True)
        trash = os.path.join(self.tmp_root, "trash-" + uuid.uuid4().hex)
        try:
            os.rename(path, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _sweep_stale(self) -> None:
        try:
            names = os.listdir(self.tmp_root)
        except OSError:
            return
        now = time.time()
        for name in names:
            path = os.path.join(self.tmp_root, name)
            try:
                if now - os.path.getmtime(path) > _STALE_TMP_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass


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
