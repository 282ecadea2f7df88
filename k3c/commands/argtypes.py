"""The CLI's argument parser class and argument types, shared by every command's parser (k3c/cli.py,
k3c/commands/*): a bad value is one line naming the flag, exit 2."""
from __future__ import annotations

import argparse
import difflib
import re

from ..errors import ArgumentError
from ..limits import MAX_SEED


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line naming the flag (not a usage dump), suggests the flag or
    command meant, and exits 2 (k3c.cli.main prints "k3c: error: " before the message)."""

    def error(self, message: str):
        m = re.match(r"argument (\S+): (.*)", message, re.S)
        if m:
            flag, rest = m.groups()
            message = rest if rest.startswith(flag.split("/")[0]) else f"{flag}: {rest}"
            bad = re.match(r"invalid choice: '([^']*)' \(choose from (.*)\)", rest)
            if bad:
                choices = re.findall(r"'([^']*)'", bad.group(2))
                message = f"{flag}: invalid choice: '{bad.group(1)}'{_did_you_mean(bad.group(1), choices)} " \
                          f"(choose from {', '.join(choices)})"
                if flag == "command":
                    message = message[len("command: "):]
        raise ArgumentError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = self._command_parser(ns) or self
            options = [o for a in sub._actions for o in a.option_strings]
            first = extras[0]
            if first.startswith("-"):
                name = first.split("=")[0]
                raise ArgumentError(f"unknown argument {name}{_did_you_mean(name, options)} "
                                    f"(see {sub.prog} --help)")
            raise ArgumentError(f"unexpected argument {first!r} (see {sub.prog} --help)")
        return ns

    def _command_parser(self, ns):
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(ns, action.dest, None) or "")
        return None


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None


def positive(name: str, maximum: int | None = None):
    def parse(text: str) -> int:
        value = integer(name, text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be <= {maximum}, got {value}")
        return value
    return parse


def count(name: str, maximum: int):
    """An integer in [0, maximum]."""
    def parse(text: str) -> int:
        value = integer(name, text)
        if not 0 <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{name} must be an integer in [0, {maximum}], got {value}")
        return value
    return parse


def seed(text: str) -> int:
    """--seed: an integer in [0, 2**63 - 1]."""
    value = integer("--seed", text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"--seed must be in [0, 2**63 - 1], got {value}")
    return value


def number(name: str):
    """A float (its range is checked where it is used: runtime.sampling.SamplingParams)."""
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
    return parse


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def escaped(text: str) -> str:
    """--prompt: the escapes \\n, \\t and \\\\ interpreted (a shell passes them as typed); any other backslash
    is kept as it is."""
    import re

    return re.sub(r"\\([nt\\])", lambda m: ESCAPES[m.group(1)], text)


def fraction(name: str):
    """A finite float in [0, 1)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number in [0, 1), got {text!r}") from None
        if not 0.0 <= value < 1.0:          # NaN fails both comparisons; inf the upper one
            raise argparse.ArgumentTypeError(f"{name} must be a number in [0, 1), got {text!r}")
        return value
    return parse


def path(name: str):
    """A path argument that is not empty (an unset shell variable: `--weights "$W"`)."""
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"{name} needs a path, got an empty string")
        return text
    return parse


def passes(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--passes needs a comma-separated list of pass names")
    return names


