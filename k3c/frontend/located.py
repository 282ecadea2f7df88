"""What the two spec loaders (YAML in yaml_loader, JSON in json_loader) share: reading a spec file's text, the
located containers they build (LocDict / LocList: the 1-based line of every key and item), and SpecErrors that
render on one line whatever user text they quote.
"""
from __future__ import annotations

import difflib
import os
import unicodedata
from typing import Any

from ..errors import SpecError
from ..paths import regular_file

MAX_SPEC_BYTES = 4 * 1024 * 1024  # any spec-like file (a YAML spec, a config.json) is refused unread above
MAX_SHOWN = 60                    # characters of user text quoted in a message


# ---------------------------------------------------------------------------------------------------------------
# one-line messages
def clean(text: Any, limit: int | None = None) -> str:
    """`text` with every control / line-separator character escaped, optionally shortened: safe on one line."""
    text = str(text)
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 3, 1)] + "..."
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or ch == " ":
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif unicodedata.category(ch) in ("Zs",):
            out.append(" ")
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def spec_error(message: str, *, file: str | None = None, line: int | None = None,
               field: str | None = None) -> SpecError:
    """A SpecError whose rendering is guaranteed to be one line (user text in any part is escaped)."""
    return SpecError(clean(message), file=None if file is None else clean(file),
                     line=line, field=None if field is None else clean(field, 200))


def did_you_mean(word: Any, options) -> str:
    """` (did you mean 'x'?)` for the option closest to a misspelt `word`, or "" when none is close."""
    word = str(word)
    if len(word) > 100:
        return ""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ---------------------------------------------------------------------------------------------------------------
class LocDict(dict):
    """A mapping that knows its own line and the line of each key (1-based)."""

    line: int | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_lines: dict[str, int] = {}


class LocList(list):
    """A list that knows its own line and the line of each item (1-based)."""

    line: int | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.item_lines: list[int] = []


# ---------------------------------------------------------------------------------------------------------------
def decode_spec_bytes(raw: bytes, file: str) -> str:
    """UTF-8 text of a spec file's bytes (BOM allowed), or a SpecError naming the file and line."""
    if len(raw) > MAX_SPEC_BYTES:
        raise spec_error(f"file is larger than {MAX_SPEC_BYTES} bytes; not a spec", file=file)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        what = "binary data (a PNG image?)" if raw.startswith(b"\x89PNG") else "binary data"
        raise spec_error(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start}; {what}, not a spec",
                         file=file, line=line) from None


def _not_regular(path: str):
    """regular_file's error for a spec path: a SpecError naming the file (the message without the path prefix)."""
    def error(message: str) -> SpecError:
        prefix = f"{path}: "
        return spec_error(message[len(prefix):] if message.startswith(prefix) else message, file=path)
    return error


def read_spec_text(path: str) -> str:
    """Read a spec file as UTF-8 text with errors that name the file."""
    try:
        if os.path.isdir(path):
            raise spec_error("is a directory, not a spec file (for a Hugging Face model dir pass it to load_spec "
                             "with a config.json inside)", file=path)
        if os.path.exists(path):                   # a FIFO, a device or a socket would block the read or never end
            regular_file(path, "spec file", error=_not_regular(path))
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise spec_error("no such file", file=path) from None
    except IsADirectoryError:
        raise spec_error("is a directory, not a spec file", file=path) from None
    except OSError as exc:
        raise spec_error(f"cannot read: {exc.strerror or exc}", file=path) from None
    except ValueError as exc:                      # e.g. a NUL character in the path
        raise spec_error(f"not a usable path ({exc})", file=path) from None
    return decode_spec_bytes(raw, path)
