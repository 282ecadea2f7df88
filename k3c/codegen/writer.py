"""Source writer for generated Triton modules (Inductor's IndentedBuffer, made strict).

Every generated module goes through a `SourceWriter`:

    w = SourceWriter()
    w.header(kernel="k3c_rmsnorm_fwd_d64_fp32", ir_op="rms_norm", loc="examples/k3-tiny.yaml:13", target=t,
             emitter=__name__)
    w.imports()
    with w.jit_function("k3c_rmsnorm_fwd_d64_fp32", ["x_ptr", "out_ptr", "M"], ["D", "BLOCK_D"]):
        w.line("row = tl.program_id(0).to(tl.int64)")
        ...
    text = w.getvalue()

Nothing from a spec is pasted raw: names go through `ident()` (a strict `[A-Za-z_][A-Za-z0-9_]*` check that also
rejects Python keywords), numbers through `num()` (formatted from a Python int/float, finite only), and free text
(the IR op, the spec location) only ever lands in a one-line comment after `comment_text()` has reduced it to
printable ASCII.
"""
from __future__ import annotations

import keyword
import math
import numbers
import re
from contextlib import contextmanager
from typing import Iterable, Iterator

from ..errors import K3cError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_IDENT_LEN = 128
MAX_COMMENT_LEN = 200


class CodegenError(K3cError):
    """A name, number or construct that must not reach generated code."""


def ident(name: object) -> str:
    """`name` if it is a safe Python/Triton identifier, else CodegenError. Never repairs a bad name."""
    if not isinstance(name, str):
        raise CodegenError(f"identifier must be a str, got {type(name).__name__}")
    if len(name) > MAX_IDENT_LEN:
        raise CodegenError(f"identifier too long ({len(name)} > {MAX_IDENT_LEN} chars)")
    if not _IDENT.fullmatch(name):
        raise CodegenError(f"invalid identifier {name!r} (must match [A-Za-z_][A-Za-z0-9_]*)")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in ("True", "False", "None"):
        raise CodegenError(f"identifier {name!r} is a Python keyword")
    return name


def name_part(value: object) -> str:
    """A fragment for a descriptive kernel name (`d7168`, `bf16`, `silu`): lower-case [a-z0-9_] only.

    Derived from a spec value, so it is sanitised (every other character becomes '_') and then checked; the full
    kernel name still goes through `ident()`."""
    text = re.sub(r"[^a-z0-9_]", "_", str(value).lower())
    text = re.sub(r"_+", "_", text).strip("_")
    if not text:
        raise CodegenError(f"empty kernel-name fragment from {value!r}")
    return text[:32]


def num(value: object) -> str:
    """Python source for a number: ints as decimal, floats via repr (finite only), bools as True/False."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        f = float(value)
        if not math.isfinite(f):
            raise CodegenError(f"non-finite number {value!r} cannot be baked into a kernel")
        return repr(f)
    raise CodegenError(f"expected an int or float, got {type(value).__name__}")


def fnum(value: object) -> str:
    """Like num() but always a float literal (so `tl.constexpr` math stays floating point)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CodegenError(f"expected a float, got {type(value).__name__}")
    return num(float(value))


def comment_text(text: object, limit: int = MAX_COMMENT_LEN) -> str:
    """`text` reduced to one line of printable ASCII (safe inside a `#` comment)."""
    s = str(text)
    s = "".join(c if 32 <= ord(c) < 127 else " " for c in s)
    s = re.sub(r"\s+", " ", s).strip()
    if len(s) > limit:
        s = s[: limit - 3] + "..."
    return s


class SourceWriter:
    """An indented line buffer. `line()` appends one line at the current indent; `indent()` nests."""

    def __init__(self, indent_unit: str = "    ") -> None:
        self._lines: list[str] = []
        self._level = 0
        self._unit = indent_unit

    # -- basic output -------------------------------------------------------------------------------------------
    def line(self, text: str = "") -> None:
        if "\n" in text or "\r" in text:
            raise CodegenError("SourceWriter.line() takes exactly one line")
        self._lines.append(self._unit * self._level + text if text else "")

    def lines(self, texts: Iterable[str]) -> None:
        for t in texts:
            self.line(t)

    def blank(self) -> None:
        self._lines.append("")

    def comment(self, text: object) -> None:
        self.line("# " + comment_text(text))

    @contextmanager
    def indent(self, n: int = 1) -> Iterator[None]:
        self._level += n
        try:
            yield
        finally:
            self._level -= n

    def getvalue(self) -> str:
        return "\n".join(self._lines) + "\n"

    # -- structure ----------------------------------------------------------------------------------------------
    def header(self, *, kernel: str, ir_op: str, loc: str, target, emitter: str, notes: Iterable[str] = ()
               ) -> None:
        """The comment block every generated module starts with: kernel, IR op + spec location, target, version."""
        from .. import __version__

        if self._lines:
            raise CodegenError("header() must come first")
        t = target
        self.comment(f"k3c generated Triton kernel: {ident(kernel)} (do not edit)")
        self.comment(f"IR op: {ir_op or '-'}  loc: {loc or '-'}")
        self.comment(f"target: {t.name} ({t.backend} {t.arch}, warp {t.warp_size}, "
                     f"shared mem {t.shared_mem_bytes} B)")
        self.comment(f"k3c {__version__}  emitter: {emitter}")
        for n in notes:
            self.comment(n)

    def imports(self) -> None:
        self.line("import triton")
        self.line("import triton.language as tl")
        self.blank()

    def gluon_imports(self, *extra: str) -> None:
        """A tier module's imports: gluon and its language as gl, then `extra` lines (arch modules)."""
        self.line("from triton.experimental import gluon")
        self.line("from triton.experimental.gluon import language as gl")
        for line in extra:
            self.line(line)

    @contextmanager
    def gluon_function(self, name: str, args: Iterable[str], constexprs: Iterable[str] = ()) -> Iterator[None]:
        """Two blank lines, then `@gluon.jit def name(args..., C: gl.constexpr, ...):` one parameter a line, with
        the body indented inside the block."""
        self.blank()
        self.blank()
        self.line("@gluon.jit")
        self.line(f"def {ident(name)}(")
        with self.indent(2):
            for a in args:
                self.line(ident(a) + ",")
            for c in constexprs:
                self.line(f"{ident(c)}: gl.constexpr,")
        self.line("):")
        with self.indent():
            yield

    @contextmanager
    def jit_function(self, name: str, args: Iterable[str], constexprs: Iterable[str] = ()) -> Iterator[None]:
        """`@triton.jit def name(args..., C: tl.constexpr, ...):` with the body indented inside the block."""
        args, constexprs = [ident(a) for a in args], [ident(c) for c in constexprs]
        dup = {a for a in args + constexprs if (args + constexprs).count(a) > 1}
        if dup:
            raise CodegenError(f"duplicate argument names {sorted(dup)}")
        params = args + [f"{c}: tl.constexpr" for c in constexprs]
        self.blank()
        self.line("@triton.jit")
        self.line(f"def {ident(name)}(")
        with self.indent(2):
            for p in params:
                self.line(p + ",")
        self.line("):")
        with self.indent():
            yield
        self.blank()
