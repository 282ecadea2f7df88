"""Every environment setting k3c reads, declared once and typed.

K3C_DEBUG: 0 quiet, 1 pass times, 2 + fusion/rewrite decisions, 3 + IR after each pass, 4 + generated Triton.
K3C_CACHE_DIR: content-addressed compile cache (default ~/.cache/k3c; not a usable directory: builds run uncached,
               with one warning).
K3C_NO_JIT: 1 = a GPU launch whose kernel is not in the bound artifact raises instead of JIT-compiling its source.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    debug: int = 0
    cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "k3c")
    no_jit: bool = False


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        print(f"k3c: ignoring {name}={value!r} (not an integer)", file=sys.stderr)
        return default


def _path_env(name: str, default: str) -> str:
    """An absolute path ('~' expanded: the value often arrives quoted); unset or blank: `default`. Whether it is a
    usable directory is for its user to find out (the compile cache falls back to an uncached build)."""
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    return os.path.abspath(os.path.expanduser(value))


def settings() -> Settings:
    """Read the environment now (cheap; tests may change it between calls)."""
    return Settings(debug=_int_env("K3C_DEBUG", 0),
                    cache_dir=_path_env("K3C_CACHE_DIR", Settings.cache_dir),
                    no_jit=_int_env("K3C_NO_JIT", 0) != 0)


def debug(level: int, message: str) -> None:
    """Print `message` to stderr when K3C_DEBUG >= level."""
    if settings().debug >= level:
        print(f"[k3c:{level}] {message}", file=sys.stderr)
