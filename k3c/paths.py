"""Checks on paths a user hands k3c, before anything reads them.

One place decides what an input file may be: a regular file (not a FIFO, a device or a socket, which block a
read forever or never end), so a careless path is one clear error instead of a hang.
"""
from __future__ import annotations

import os
import stat

from .errors import ArgumentError


def regular_file(path: str | os.PathLike, what: str = "file", *, error=ArgumentError) -> str:
    """`path` as a str when it names an existing regular file (a symlink to one is fine); otherwise raise
    `error` naming the path and what it is instead. `error` is called with the message (SpecError callers pass a
    lambda that adds file=)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except (OSError, ValueError) as exc:             # ValueError: a NUL in the path
        raise error(f"{path}: cannot use as a {what} ({getattr(exc, 'strerror', None) or exc})") from None
    if stat.S_ISREG(st.st_mode):
        return path
    raise error(f"{path}: is {_kind(st.st_mode)}, not a regular {what}")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"
