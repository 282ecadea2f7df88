"""The one output-directory policy: what k3c may write over, and how a directory it writes is put in place.

Every directory k3c writes (`k3c compile -o`, `k3c quantize -o`, `--dump-ir`, the cache's artifacts) goes through
here:

- the path is checked before any long work: not a symlink, not a file, every name at most 255 bytes, the nearest
  existing parent a directory k3c can create entries in;
- an existing directory is used only when it is empty or something k3c wrote of the same kind (an artifact, a
  quantized checkpoint, an IR dump directory) holding nothing but k3c's files; replacing it needs `overwrite`
  (`--force`; IR dump directories are always replaced). A directory holding a file k3c did not write is refused,
  `--force` or not, naming the file: k3c never deletes what it did not write;
- the new directory is written complete into a staging folder beside it (`.k3c-tmp-<name>-<pid>-<hex>`) and put in
  place by one atomic rename; an existing one is swapped out atomically (renameat2 RENAME_EXCHANGE where the file
  system has it, else renamed aside to `.k3c-old-<name>-<pid>-<hex>` first) and deleted only once the new one is
  in place, so a reader sees the old or the new directory, complete; concurrent writers retry and all succeed;
- staging and old folders of the same name left by a process that died are swept at the next write beside them.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat

from .errors import ArgumentError, UserError
from .limits import MAX_JSON_DEPTH

NAME_MAX = 255                  # bytes per path component (ext4, xfs, btrfs, tmpfs)
JSON_LIMIT = 64 << 20           # largest manifest.json / quantization.json k3c reads
ARTIFACT, QUANTIZED, DUMP = "artifact", "quantized checkpoint", "IR dump directory"
ARTIFACT_FORMAT = "k3c-artifact/1"
QUANT_FILES = ("model.safetensors", "quantization.json")
_DUMP_NAME = re.compile(r"^\d{3}_[A-Za-z0-9_.+-]+\.k3c$")
_DUMP_MAGIC = b"# k3c IR dump "
_STAGING = re.compile(r"^\.k3c-(?:tmp|old|probe)-")


# ---- what a directory is -----------------------------------------------------------------------------------------

def read_json(path: str, *, error=UserError, limit: int = JSON_LIMIT, dir_fd: int | None = None):
    """A small JSON file read without following a symlink or blocking on a FIFO: `error` naming the file when it
    is not a regular file, larger than `limit`, or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{path}: is a symlink; k3c does not follow symlinks in its outputs") from None
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            from .paths import _kind

            raise error(f"{path}: is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise error(f"{path}: {st.st_size} bytes, more than the {limit >> 20} MiB a k3c record may have")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)
    finally:
        os.close(fd)
    return loads_json(data, path, error=error)


def loads_json(data: bytes | str, where: str, *, error=UserError):
    """The value of JSON text read from `where`: `error` naming it when the text is not UTF-8 JSON or nests deeper
    than MAX_JSON_DEPTH (Python's parser recurses: 100,000 levels would be a RecursionError, not an error line)."""
    try:
        value = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except RecursionError:
        value = None
        deep = True
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{where}: not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    else:
        deep = False
        stack = [(value, 1)] if isinstance(value, (dict, list)) else []
        while stack and not deep:
            v, depth = stack.pop()
            if depth > MAX_JSON_DEPTH:
                deep = True
            stack += [(c, depth + 1) for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
    if deep:
        raise error(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _record(path: str, name: str):
    try:
        return read_json(os.path.join(path, name))
    except (FileNotFoundError, NotADirectoryError, UserError):
        return None


def classify(path: str) -> tuple[str | None, str | None]:
    """(kind, foreign) of an existing directory: kind is "empty", ARTIFACT, QUANTIZED, DUMP or None (not written
    by k3c); foreign is the first entry (relative path) k3c did not write, None when there is none."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise ArgumentError(f"{path}: cannot read the directory ({exc.strerror})") from None
    names = [n for n in names if not _STAGING.match(n)]      # k3c's own staging (a dump dir's, inside -o)
    if not names:
        return "empty", None
    manifest = _record(path, "manifest.json") if "manifest.json" in names else None
    if isinstance(manifest, dict) and manifest.get("format") == ARTIFACT_FORMAT:
        return ARTIFACT, _foreign_in_artifact(path, manifest)
    quant = _record(path, "quantization.json") if "quantization.json" in names else None
    if isinstance(quant, dict) and quant.get("format") == "mxfp4" and "k3c_version" in quant:
        extra = [n for n in names if n not in QUANT_FILES or not _is_regular(os.path.join(path, n))]
        return QUANTIZED, extra[0] if extra else None
    if is_dump_dir(path):
        return DUMP, None
    if all(is_dump_dir(os.path.join(path, n)) for n in names):
        return "empty", None            # only IR dump directories (k3c's): as good as empty, they are carried over
    return None, names[0]


def _is_regular(full: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(full).st_mode)
    except OSError:
        return False


def is_dump_dir(path: str) -> bool:
    """A non-empty directory of `--dump-ir` files only (NNN_<stage>.k3c starting with k3c's dump header)."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            return False
        names = [n for n in os.listdir(path) if not _STAGING.match(n)]
    except OSError:
        return False
    if not names:
        return False
    for n in names:
        full = os.path.join(path, n)
        if not _DUMP_NAME.match(n) or not _is_regular(full):
            return False
        try:
            with open(full, "rb") as fh:
                if fh.read(len(_DUMP_MAGIC)) != _DUMP_MAGIC:
                    return False
        except OSError:
            return False
    return True


def artifact_files(manifest: dict) -> set[str] | None:
    """The files an artifact's manifest says k3c wrote (its sha256 list and manifest.json); None without a list
    (an artifact of an older k3c)."""
    listed = manifest.get("sha256")
    if not isinstance(listed, dict) or not all(isinstance(k, str) for k in listed):
        return None
    return set(listed) | {"manifest.json"}


def _foreign_in_artifact(path: str, manifest: dict) -> str | None:
    owned = artifact_files(manifest)
    for dirpath, dirs, files in os.walk(path):
        rel_dir = os.path.relpath(dirpath, path)
        for d in list(dirs):
            if os.path.islink(os.path.join(dirpath, d)):
                files.append(d)             # a symlink is never k3c's
                dirs.remove(d)
        if rel_dir == ".":
            for d in list(dirs):
                if _STAGING.match(d):
                    dirs.remove(d)
                elif d != "ir" and is_dump_dir(os.path.join(dirpath, d)):
                    dirs.remove(d)          # IR dumps of a --dump-ir inside -o: k3c's, listed or not
        for f in sorted(files):
            rel = f if rel_dir == "." else f"{rel_dir}/{f}".replace(os.sep, "/")
            if owned is not None:
                full = os.path.join(dirpath, f)
                ok = rel in owned and (_is_regular(full) or not os.path.lexists(full))   # gone: not a user's
            else:                           # older artifact: its known layout
                top = rel.split("/")[0]
                ok = rel in ("manifest.json", "spec.yaml", "model.k3c", "report.md") or top in ("ir", "kernels")
            if not ok and not (rel_dir == "." and _STAGING.match(f)):
                return rel
    return None


# ---- the checks ----------------------------------------------------------------------------------------------------

def _short(name: str) -> str:
    """The output's name as staging names carry it (short enough that the staging name fits NAME_MAX)."""
    if len(name.encode()) <= 100:
        return name
    return name[:60].encode()[:60].decode(errors="ignore") + "~" + hashlib.sha1(name.encode()).hexdigest()[:10]


def check_output_dir(path: str | os.PathLike, overwrite: bool = False, *, kind: str = ARTIFACT, what: str = "-o",
                     keep: str | os.PathLike | None = None) -> str:
    """The absolute output path when k3c may write `kind` there; otherwise an ArgumentError naming `what` and the
    path. Call it before long work (the CLI calls it before compiling). `keep`: a directory inside the path this
    run writes first (the --dump-ir dumps), which does not count as something already there."""
    try:
        raw = os.fspath(path)
    except TypeError:
        raise ArgumentError(f"{what}: not a path: {path!r}") from None
    if not raw or "\0" in raw:
        raise ArgumentError(f"{what} {raw!r}: not a usable path")
    path = os.path.abspath(raw)
    for part in path.split(os.sep):
        if len(os.fsencode(part)) > NAME_MAX:
            raise ArgumentError(f"{what} {raw[:80]}...: the name {part[:40]}... is {len(os.fsencode(part))} bytes, "
                                f"more than the {NAME_MAX} a file name may have")
    if os.path.islink(path):
        raise ArgumentError(f"{what} {path}: is a symlink; k3c does not write through symlinks (give the directory "
                            f"it points to, or another path)")
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise ArgumentError(f"{what} {path}: exists and is not a directory")
        _check_stable(path, overwrite, kind, what, keep)
    _check_parent(path, what)
    return path


def identity(path: str):
    """What tells one directory at `path` from the next one put there (None: nothing there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _check_stable(path: str, overwrite: bool, kind: str, what: str, keep) -> None:
    """_check_existing, again when another writer swapped the directory while it was being looked at."""
    for attempt in range(10):
        before = identity(path)
        try:
            _check_existing(path, overwrite, kind, what, keep)
            return
        except ArgumentError:
            if attempt == 9 or identity(path) == before:
                raise


def _check_existing(path: str, overwrite: bool, kind: str, what: str, keep) -> None:
    found, foreign = classify(path)
    if found == "empty":
        keep_name = os.path.basename(os.path.abspath(os.fspath(keep))) if keep is not None else None
        others = [n for n in os.listdir(path) if not _STAGING.match(n) and n != keep_name]
        if others and not overwrite:
            raise ArgumentError(f"{what} {path}: exists and holds IR dumps ({others[0]}); pass --force to replace "
                                f"it")
        return
    if found is None:
        raise ArgumentError(f"{what} {path}: exists, is not empty and is not a k3c {kind} (it holds {foreign}); "
                            f"k3c replaces only what it wrote, with or without --force: choose another path or "
                            f"empty it")
    if found != kind:
        raise ArgumentError(f"{what} {path}: is a k3c {found}, not a k3c {kind}; choose another path")
    if foreign is not None:
        raise ArgumentError(f"{what} {path}: the k3c {kind} there holds {foreign}, which k3c did not write; k3c "
                            f"replaces only what it wrote, with or without --force: move that file out or choose "
                            f"another path")
    if not overwrite and kind != DUMP:
        raise ArgumentError(f"{what} {path}: a k3c {kind} exists there; pass --force to replace it")


def _check_parent(path: str, what: str) -> None:
    parent = os.path.dirname(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ArgumentError(f"{what} {path}: {parent} is not a directory")
    try:                                    # the real test (root passes os.access on a read-only file system)
        os.rmdir(_mkdir_unique(parent, "probe", os.path.basename(path)))
    except OSError as exc:
        raise ArgumentError(f"{what} {path}: cannot create it in {parent} ({exc.strerror})") from None


def _mkdir_unique(parent: str, role: str, name: str) -> str:
    for _ in range(100):
        full = os.path.join(parent, f".k3c-{role}-{_short(name)}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(full, 0o755)
            return full
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free staging name", parent)


# ---- staging, publishing, sweeping ---------------------------------------------------------------------------------

def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host may still run, so that what it is writing is not swept: only a pid that
    does not exist is dead (EPERM: someone else's live process; pid <= 0 is never a writer's)."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True
    return True


def sweep(parent: str, name: str) -> list[str]:
    """Delete the staging / old folders of output `name` in `parent` whose process is gone; returns them."""
    pattern = re.compile(r"^\.k3c-(?:tmp|old|probe)-" + re.escape(_short(name)) + r"-(\d+)-[0-9a-f]+$")
    swept = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return swept
    for entry in entries:
        m = pattern.match(entry)
        full = os.path.join(parent, entry)
        if m and not pid_alive(int(m.group(1))) and not os.path.islink(full) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
            swept.append(full)
    return swept


def swap_in_progress(path: str) -> bool:
    """A writer has the directory at `path` renamed aside right now (a `.k3c-old-<name>-*` folder beside it)."""
    parent, name = os.path.split(os.path.abspath(path))
    prefix = f".k3c-old-{_short(name)}-"
    try:
        return any(n.startswith(prefix) for n in os.listdir(parent))
    except OSError:
        return False


_RENAME_EXCHANGE = 2
_renameat2 = None


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    global _renameat2
    if _renameat2 is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (OSError, AttributeError):
            _renameat2 = False
    if not _renameat2:
        return False
    at_fdcwd = -100
    if _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    if err == errno.ENOENT:                 # b vanished (another writer moved it aside): the caller retries
        raise FileNotFoundError(err, os.strerror(err), b)
    raise OSError(err, os.strerror(err), b)


class Staging:
    """A staging folder beside `path` to write a complete output into, then `commit()` it into place (or `abort()`).

    The path is checked (check_output_dir) and stale staging of the same name swept when it is made; the check is
    made again just before an existing directory is swapped out."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, kind: str = ARTIFACT, what: str = "-o",
                 keep: str | os.PathLike | None = None, replace_any: bool = False):
        self.kind, self.what, self.overwrite, self.replace_any = kind, what, overwrite, replace_any
        if replace_any:                     # a directory k3c owns outright (the cache): only the path must be sane
            self.path = os.path.abspath(os.fspath(path))
        else:
            self.path = check_output_dir(path, overwrite, kind=kind, what=what, keep=keep)
        self.keep = keep
        parent, name = os.path.split(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
            sweep(parent, name)
            self.dir = _mkdir_unique(parent, "tmp", name)
        except OSError as exc:
            raise ArgumentError(f"{what} {self.path}: cannot create it ({exc.strerror})") from None
        self.done = False

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.done:
            self.abort()

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.done = True

    def commit(self) -> str:
        """Put the staging folder in place of the path; the old directory (if any) is deleted once it is."""
        parent, name = os.path.split(self.path)
        try:
            for _ in range(50):
                try:
                    os.rename(self.dir, self.path)          # no directory there, or an empty one
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                if not self.replace_any:                    # what is there now must still be replaceable
                    try:
                        mode = os.lstat(self.path).st_mode  # one look: a writer may move it aside at any time
                    except FileNotFoundError:
                        continue                            # moved aside by another writer: try the rename again
                    if not stat.S_ISDIR(mode):
                        raise ArgumentError(f"{self.what} {self.path}: replaced by something else while k3c was "
                                            f"writing; nothing was changed")
                    try:
                        _check_stable(self.path, self.overwrite, self.kind, self.what, self.keep)
                    except (ArgumentError, FileNotFoundError):
                        if not os.path.lexists(self.path):
                            continue
                        raise
                try:
                    if _exchange(self.dir, self.path):      # self.dir now holds the old directory
                        shutil.rmtree(self.dir, ignore_errors=True)
                        break
                    old = _mkdir_unique(parent, "old", name)
                    try:
                        os.rename(self.path, old)           # aside (onto the empty placeholder)
                    except OSError:
                        os.rmdir(old)
                        raise
                except FileNotFoundError:
                    continue                                # another writer moved it: try again
                try:
                    os.rename(self.dir, self.path)
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        try:
                            os.rename(old, self.path)       # the old one back: nothing lost
                        except OSError:
                            pass
                        raise
                    continue                                # another writer's landed first: swap it out too
                finally:
                    shutil.rmtree(old, ignore_errors=True)
                break
            else:
                raise ArgumentError(f"{self.what} {self.path}: other processes kept replacing it; not written")
        except OSError as exc:              # the staging folder stays for the caller (with-block) to drop
            raise ArgumentError(f"{self.what} {self.path}: cannot put it in place ({exc.strerror})") from None
        self.done = True
        return self.path


# ---- files ---------------------------------------------------------------------------------------------------------
# The same policy for the single files k3c writes (`k3c inspect -o`, `--format dot|onnx -o`, `k3c plan --plot`,
# `k3c calibrate-router -o`): an existing file is replaced only with `overwrite` (--force), never through a symlink
# and never a directory; the new file is written beside it and put in place by one rename (a reader sees the old
# or the new file, complete), or by a hard link where it must not replace a file that appeared meanwhile.

def check_output_file(path: str | os.PathLike, overwrite: bool = False, *, what: str = "-o") -> str:
    """The absolute path when k3c may write a file there; otherwise an ArgumentError naming `what` and the path.
    Call it before long work."""
    try:
        raw = os.fspath(path)
    except TypeError:
        raise ArgumentError(f"{what}: not a path: {path!r}") from None
    if not raw or "\0" in raw:
        raise ArgumentError(f"{what} {raw!r}: needs a file name, got an empty string" if not raw
                            else f"{what} {raw!r}: not a usable file name")
    path = os.path.abspath(raw)
    if len(os.fsencode(os.path.basename(path))) > NAME_MAX:
        raise ArgumentError(f"{what} {raw[:80]}...: the file name is more than the {NAME_MAX} bytes a name may have")
    if os.path.islink(path):
        raise ArgumentError(f"{what} {raw}: is a symlink; k3c does not write through symlinks")
    if os.path.isdir(path):
        raise ArgumentError(f"{what} {raw}: is a directory; give a file name")
    if os.path.lexists(path) and not overwrite:
        raise ArgumentError(f"{what} {raw}: exists; pass --force to replace it")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ArgumentError(f"{what} {raw}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArgumentError(f"{what} {raw}: cannot create files in {parent}")
    return path


def staged_file(path: str) -> str:
    """A new temporary name beside `path` (same extension: writers that pick a format by it keep working)."""
    parent, name = os.path.split(os.path.abspath(path))
    ext = os.path.splitext(name)[1]
    return os.path.join(parent, f".k3c-tmp-{_short(name)}-{os.getpid()}-{secrets.token_hex(4)}{ext}")


def put_file(tmp: str, path: str | os.PathLike, overwrite: bool = False, *, what: str = "-o") -> None:
    """Put the finished file `tmp` in place at `path` (check_output_file's policy, checked again now); `tmp` is
    gone afterwards, whatever happens."""
    raw = os.fspath(path)
    try:
        path = check_output_file(raw, overwrite, what=what)
        try:
            if overwrite:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)              # fails if a file appeared since the check: nothing replaced
        except FileExistsError:
            raise ArgumentError(f"{what} {raw}: exists; pass --force to replace it") from None
        except OSError as exc:
            raise ArgumentError(f"{what} {raw}: cannot write it ({exc.strerror or exc})") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def write_file(path: str | os.PathLike, data: bytes, overwrite: bool = False, *, what: str = "-o") -> None:
    """`data` written to `path` under the file policy."""
    check_output_file(path, overwrite, what=what)
    tmp = staged_file(os.fspath(path))
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
    except OSError as exc:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise ArgumentError(f"{what} {os.fspath(path)}: cannot write it ({exc.strerror or exc})") from None
    put_file(tmp, path, overwrite, what=what)
