"""Safe YAML loading that remembers the line of every key and list item.

Only YAML's safe types are constructed (no `!!python/...` tags), duplicate keys are errors, and every failure is a
SpecError naming the file and line.
"""
from __future__ import annotations

import yaml

from ..errors import SpecError

MAX_SPEC_BYTES = 4 * 1024 * 1024


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


class _LocatingSafeLoader(yaml.SafeLoader):
    """SafeLoader whose mappings and sequences carry line numbers."""

    spec_file = "<spec>"


def _construct_mapping(loader: _LocatingSafeLoader, node: yaml.MappingNode) -> LocDict:
    loader.flatten_mapping(node)
    out = LocDict()
    out.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise SpecError(f"keys must be strings, got {type(key).__name__} {key!r}",
                            file=loader.spec_file, line=line)
        if key in out:
            raise SpecError(f"duplicate key '{key}' (first at line {out.key_lines[key]})",
                            file=loader.spec_file, line=line, field=key)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = line
    return out


def _construct_sequence(loader: _LocatingSafeLoader, node: yaml.SequenceNode) -> LocList:
    out = LocList()
    out.line = node.start_mark.line + 1
    for child in node.value:
        out.append(loader.construct_object(child, deep=True))
        out.item_lines.append(child.start_mark.line + 1)
    return out


_LocatingSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LocatingSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def load_yaml_text(text: str, file: str) -> LocDict:
    """Parse spec text into a LocDict; raise SpecError with file and line on any problem."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"file is larger than {MAX_SPEC_BYTES} bytes; not a spec", file=file)
    if "\x00" in text:
        raise SpecError("file contains NUL bytes; not a YAML spec", file=file, line=text[:text.index("\x00")].count("\n") + 1)

    loader_cls = type("_Loader", (_LocatingSafeLoader,), {"spec_file": file})
    try:
        data = yaml.load(text, Loader=loader_cls)  # SafeLoader subclass: safe types only
    except SpecError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        if "python/" in str(problem) or "could not determine a constructor" in str(problem):
            problem = f"tag not allowed in a spec ({problem.split('for the tag')[-1].strip() or 'unknown tag'})"
        raise SpecError(f"YAML error: {problem}", file=file, line=line) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"YAML error: {str(exc).splitlines()[0]}", file=file) from None
    except RecursionError:
        raise SpecError("YAML nesting too deep", file=file) from None
    if data is None:
        raise SpecError("spec is empty", file=file, line=1)
    if not isinstance(data, LocDict):
        raise SpecError(f"top level must be a mapping of sections, got {type(data).__name__}", file=file, line=1)
    return data


def read_spec_text(path: str) -> str:
    """Read a spec file as UTF-8 text with errors that name the file."""
    import os

    if os.path.isdir(path):
        raise SpecError("is a directory, not a spec file (for a Hugging Face model dir pass it to load_spec "
                        "with a config.json inside)", file=path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError("no such file", file=path) from None
    except OSError as exc:
        raise SpecError(f"cannot read: {exc.strerror}", file=path) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpecError("not UTF-8 text (binary file?)", file=path, line=line) from None
