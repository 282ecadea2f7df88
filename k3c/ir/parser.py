"""IR text parser: reads what printer.py writes (docs/ir.md has the grammar). Never evaluates text.

Each line is tokenized by one regular expression and parsed by a small recursive-descent reader. `#` starts a
comment outside string literals. Errors are IRParseError carrying the line number (`err.line`, and `file:line`
as its loc).
"""
from __future__ import annotations

import re

from ..errors import IRError, IRParseError
from .core import Module, Op, TensorType

# One alternation; a token's kind is read from its first character (cheaper than named groups).
_TOKEN = re.compile(r"""\s*(?:
    (\#.*)                                                   # comment: ends the line
  | ( %[A-Za-z0-9_][A-Za-z0-9_.]*                             # %value
    | @[A-Za-z0-9_][A-Za-z0-9_.\-]*                          # @symbol
    | "(?:[^"\\]|\\.)*"                                      # "string"
    | -?(?:\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+) | -inf\b   # float
    | -?\d+                                                 # int
    | [A-Za-z_][A-Za-z0-9_.]*                               # identifier / keyword
    | [(){}\[\],=:] )                                        # punctuation
  | (\S) )""", re.VERBOSE | re.ASCII)
_FLOAT_CHARS = frozenset(".eEi")

_ESCAPE = re.compile(r"\\(?:u\{([0-9a-fA-F]{1,6})\}|(.))")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r"}
_KEYWORD_VALUES = {"true": True, "false": False, "none": None, "inf": float("inf"), "nan": float("nan")}


class _Fail(Exception):
    def __init__(self, message: str, col: int | None = None):
        super().__init__(message)
        self.col = col


def _unescape(text: str, col: int) -> str:
    body = text[1:-1]
    if "\\" not in body:
        return body

    def sub(m: re.Match) -> str:
        if m.group(1) is not None:
            cp = int(m.group(1), 16)
            if cp > 0x10FFFF:
                raise _Fail(f"escape \\u{{{m.group(1)}}} is not a code point", col)
            return chr(cp)
        if m.group(2) in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[m.group(2)]
        raise _Fail(f"unknown escape '\\{m.group(2)}' in string", col)

    return _ESCAPE.sub(sub, body)


def _kind(tok: str) -> str:
    c = tok[0]
    if c == "%":
        return "value"
    if c == "@":
        return "sym"
    if c == '"':
        return "str"
    if c.isdigit() or c == "-":
        return "float" if _FLOAT_CHARS.intersection(tok) else "int"
    if c.isalpha() or c == "_":
        return "ident"
    return "punct"


def _tokenize(line: str) -> list[tuple[str, str, int | None]]:
    toks = []
    for comment, tok, err in _TOKEN.findall(line):
        if comment:
            break
        if err:
            col = next(m.start(3) + 1 for m in _TOKEN.finditer(line) if m.group(3))
            raise _Fail("unterminated string literal" if err == '"' else f"unexpected character {err!r}", col)
        toks.append((_kind(tok), tok, None))
    return toks


class _Reader:
    """Tokens of one line."""

    __slots__ = ("toks", "pos")

    def __init__(self, toks):
        self.toks = toks
        self.pos = 0

    def peek(self, offset: int = 0):
        i = self.pos + offset
        return self.toks[i] if i < len(self.toks) else ("eol", "end of line", None)

    def next(self):
        tok = self.peek()
        self.pos += 1
        return tok

    def at(self, kind: str, text: str | None = None) -> bool:
        k, t, _ = self.peek()
        return k == kind and (text is None or t == text)

    def accept(self, kind: str, text: str | None = None):
        if self.at(kind, text):
            return self.next()
        return None

    def expect(self, kind: str, text: str | None = None, what: str | None = None):
        tok = self.peek()
        if tok[0] != kind or (text is not None and tok[1] != text):
            want = what or (repr(text) if text else kind)
            raise _Fail(f"expected {want}, got {_show(tok)}", tok[2])
        self.pos += 1
        return tok

    def at_call(self) -> bool:
        """The current identifier is followed by '(' (an op, not the `return` statement)."""
        nxt = self.peek(1)
        return nxt[0] == "punct" and nxt[1] == "("

    def done(self) -> None:
        if self.pos < len(self.toks):
            raise _Fail(f"unexpected {_show(self.peek())} after the end of the statement", self.peek()[2])

    # -- grammar pieces ----------------------------------------------------------------------------------
    def values(self) -> list[str]:
        out = [self.expect("value", what="a %value")[1][1:]]
        while self.accept("punct", ","):
            out.append(self.expect("value", what="a %value")[1][1:])
        return out

    def scalar(self):
        kind, text, col = self.next()
        if kind == "str":
            return _unescape(text, col)
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "ident" and text in _KEYWORD_VALUES:
            return _KEYWORD_VALUES[text]
        raise _Fail(f"expected an attribute value, got {_show((kind, text, col))}", col)

    def attr_value(self):
        if self.accept("punct", "["):
            items = []
            if not self.accept("punct", "]"):
                items.append(self.scalar())
                while self.accept("punct", ","):
                    items.append(self.scalar())
                self.expect("punct", "]")
            return tuple(items)
        return self.scalar()

    def attr_dict(self) -> list[tuple[str, object]]:
        self.expect("punct", "{")
        out = []
        if self.accept("punct", "}"):
            return out
        while True:
            key = self.expect("ident", what="an attribute name")[1]
            self.expect("punct", "=")
            out.append((key, self.attr_value()))
            if self.accept("punct", "}"):
                return out
            self.expect("punct", ",", what="',' or '}'")

    def tensor_type(self) -> TensorType:
        dtype = self.expect("ident", what="a type such as bf16[B, T, 64]")[1]
        self.expect("punct", "[")
        dims: list = []
        if not self.accept("punct", "]"):
            while True:
                kind, text, col = self.next()
                if kind == "int":
                    dims.append(int(text))
                elif kind == "ident":
                    dims.append(text)
                else:
                    raise _Fail(f"expected a dimension (integer or symbol), got {_show((kind, text, col))}", col)
                if self.accept("punct", "]"):
                    break
                self.expect("punct", ",", what="',' or ']'")
        return TensorType(dtype, tuple(dims))


def _show(tok) -> str:
    kind, text, _ = tok
    return "end of line" if kind == "eol" else repr(text)


def _op(r: _Reader, loc_default: str) -> Op:
    results: list[str] = []
    if r.at("value"):
        results = r.values()
        r.expect("punct", "=")
    name = r.expect("ident", what="an op name")[1]
    r.expect("punct", "(")
    inputs = [] if r.at("punct", ")") else r.values()
    r.expect("punct", ")")
    attrs = r.attr_dict() if r.at("punct", "{") else []
    types: list[TensorType] = []
    if r.accept("punct", ":"):
        types.append(r.tensor_type())
        while r.accept("punct", ","):
            types.append(r.tensor_type())
    loc = loc_default
    if r.accept("ident", "loc"):
        r.expect("punct", "(")
        kind, text, col = r.expect("str", what="a loc string")
        loc = _unescape(text, col)
        r.expect("punct", ")")
    r.done()
    return Op(tuple(results), name, tuple(inputs), tuple(attrs), tuple(types), loc)


def parse_module(text: str, source: str = "<ir>") -> Module:
    """Parse IR text into a Module. Raises IRParseError naming `source:line`."""
    name = None
    attrs: list = []
    ops: list[Op] = []
    outputs: tuple[str, ...] | None = None
    closed = False
    lineno = 0
    try:
        for lineno, line in enumerate(text.splitlines(), 1):
            stripped = line.strip()
            if not stripped or stripped[0] == "#":
                continue
            r = _Reader(_tokenize(line))
            if not r.toks:
                continue
            if closed:
                raise _Fail("text after the end of the module", r.peek()[2])
            if name is None:
                r.expect("ident", "module", what="'module @name'")
                name = r.expect("sym", what="a module name such as @k3_tiny")[1][1:]
                if r.accept("ident", "attributes"):
                    attrs = r.attr_dict()
                r.expect("punct", "{")
                r.done()
            elif r.at("ident", "return") and not r.at_call():
                if outputs is not None:
                    raise _Fail("a second 'return'", r.peek()[2])
                r.next()
                outputs = tuple(r.values()) if r.at("value") else ()
                r.done()
            elif r.at("punct", "}"):
                r.next()
                r.done()
                if outputs is None:
                    raise _Fail("the module ends without a 'return'", 1)
                closed = True
            else:
                if outputs is not None:
                    raise _Fail("an op after 'return'", r.peek()[2])
                ops.append(_op(r, ""))
        if name is None:
            raise _Fail("no 'module @name {' found")
        if not closed:
            raise _Fail("missing '}' at the end of the module")
        return Module(name, tuple(ops), outputs, tuple(attrs))
    except _Fail as e:
        raise _error(str(e), source, max(lineno, 1), e.col) from None
    except IRParseError:
        raise
    except IRError as e:   # a constructor rejected the parsed pieces (bad dims, type count, ...)
        raise _error(e.message, source, max(lineno, 1), None) from None


def _error(message: str, source: str, line: int, col: int | None) -> IRParseError:
    where = f"{source}:{line}" + (f":{col}" if col else "")
    err = IRParseError(message, loc=where)
    err.line = line
    err.source = source
    return err


def parse_file(path: str) -> Module:
    with open(path, encoding="utf-8") as f:
        return parse_module(f.read(), source=path)
