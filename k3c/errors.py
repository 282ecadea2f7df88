"""Error types. User-facing errors render as one line; the CLI maps them to exit codes (2 = bad input)."""
from __future__ import annotations


class K3cError(Exception):
    """Base of every error k3c raises on purpose."""

    exit_code = 1


class UserError(K3cError):
    """Bad input from the user (spec, arguments, weights): exit code 2, one line, no traceback."""

    exit_code = 2


class SpecError(UserError):
    """A problem in a spec file, located by file, line and dotted field path."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None):
        self.message = message
        self.file = file
        self.line = line
        self.field = field
        super().__init__(self.render())

    def render(self) -> str:
        where = self.file or "<spec>"
        if self.line is not None:
            where += f":{self.line}"
        what = f"field '{self.field}': " if self.field else ""
        return f"{where}: {what}{self.message}"


class ArgumentError(UserError):
    """A bad command-line or API argument."""


class WeightError(UserError):
    """A checkpoint that does not match the spec (missing tensor, wrong shape or dtype)."""


class IRError(K3cError):
    """A malformed IR module (verifier or parser failure)."""

    def __init__(self, message: str, *, op: str | None = None, loc: str | None = None,
                 pass_name: str | None = None):
        self.message = message
        self.op = op
        self.loc = loc
        self.pass_name = pass_name
        super().__init__(self.render())

    def render(self) -> str:
        parts = []
        if self.pass_name:
            parts.append(f"after pass '{self.pass_name}'")
        if self.op:
            parts.append(f"op {self.op}")
        if self.loc:
            parts.append(f"at {self.loc}")
        prefix = ", ".join(parts)
        return f"{prefix}: {self.message}" if prefix else self.message


class IRParseError(IRError, UserError):
    """Text that is not valid k3c IR (exit code 2 when it came from the user)."""

    exit_code = 2
