"""Strict JSON with line numbers: a config.json parsed into LocDict / LocList, so that every error about it can
name the file, the line and the dotted key.
"""
from __future__ import annotations

import bisect
import json
import re
from typing import Any

from .located import MAX_SPEC_BYTES, LocDict, LocList, spec_error


class _JSONLocator:
    """A strict JSON parser producing LocDict / LocList with the 1-based line of every key and item.

    The text is first validated by the stdlib parser (whose messages carry line and column), then re-scanned here
    for positions. Duplicate keys are errors (json.loads would silently keep the last one).
    """

    _WS = re.compile(r"[ \t\n\r]*")
    _NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?")

    def __init__(self, text: str, file: str):
        self.text = text
        self.file = file
        self.newlines = [i for i, ch in enumerate(text) if ch == "\n"]

    def line(self, pos: int) -> int:
        return bisect.bisect_left(self.newlines, pos) + 1

    def parse(self) -> Any:
        value, pos = self._value(self._ws(0))
        return value

    def _ws(self, pos: int) -> int:
        return self._WS.match(self.text, pos).end()

    def _value(self, pos: int):
        text = self.text
        ch = text[pos]
        if ch == "{":
            out = LocDict()
            out.line = self.line(pos)
            pos = self._ws(pos + 1)
            if text[pos] == "}":
                return out, pos + 1
            while True:
                key_line = self.line(pos)
                key, pos = json.decoder.scanstring(text, pos + 1)
                if key in out:
                    raise spec_error(f"duplicate key '{key}' (first at line {out.key_lines[key]})", file=self.file,
                                     line=key_line, field=key)
                pos = self._ws(self._ws(pos) + 1)          # skip ':'
                value, pos = self._value(pos)
                out[key] = value
                out.key_lines[key] = key_line
                pos = self._ws(pos)
                if text[pos] == "}":
                    return out, pos + 1
                pos = self._ws(pos + 1)                    # skip ','
        if ch == "[":
            out = LocList()
            out.line = self.line(pos)
            pos = self._ws(pos + 1)
            if text[pos] == "]":
                return out, pos + 1
            while True:
                out.item_lines.append(self.line(pos))
                value, pos = self._value(pos)
                out.append(value)
                pos = self._ws(pos)
                if text[pos] == "]":
                    return out, pos + 1
                pos = self._ws(pos + 1)
        if ch == '"':
            return json.decoder.scanstring(text, pos + 1)
        for word, value in (("true", True), ("false", False), ("null", None)):
            if text.startswith(word, pos):
                return value, pos + len(word)
        m = self._NUMBER.match(text, pos)
        literal = m.group(0)
        return (float(literal) if m.group(1) or m.group(2) else int(literal)), m.end()


def parse_json_located(text: str, file: str) -> Any:
    """Parse JSON text into LocDict/LocList; SpecError with file and line (and column) on any problem."""
    if len(text) > MAX_SPEC_BYTES:
        raise spec_error(f"file is larger than {MAX_SPEC_BYTES} bytes; not a model config", file=file)

    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        json.loads(text, parse_constant=no_constants)
    except json.JSONDecodeError as exc:
        raise spec_error(f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", file=file,
                         line=exc.lineno) from None
    except ValueError as exc:
        raise spec_error(f"invalid JSON: {exc}", file=file) from None
    except RecursionError:
        raise spec_error("JSON nesting too deep", file=file) from None
    try:
        return _JSONLocator(text, file).parse()
    except RecursionError:
        raise spec_error("JSON nesting too deep", file=file) from None
