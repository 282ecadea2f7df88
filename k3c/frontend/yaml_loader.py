"""Safe YAML loading that remembers the line of every key and list item.

Only YAML's safe types are constructed (no `!!python/...` tags), duplicate keys are errors, and every failure is a
SpecError naming the file, the line and (once construction has started) the dotted field path. The rendered error is
always a single line.

Hostile input is bounded before it can cost much: text over MAX_YAML_BYTES is refused unparsed, composition stops
after MAX_NODES nodes or MAX_DEPTH levels of nesting, and a document whose aliases would expand to more than
MAX_EXPANDED_NODES values (a "billion laughs" bomb, merge-key bombs included) or that refers to itself is refused
before anything is constructed.

Merge keys (`<<: *defaults`) work as in YAML 1.1: explicit keys override merged ones; a key written twice in the same
mapping is an error. Plain scalars resolve by the YAML 1.2 core schema; SpecDumper writes YAML that reads back the same
under both 1.1 and 1.2.
"""
from __future__ import annotations

import math
import re

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from ..errors import SpecError
from .located import MAX_SHOWN, LocDict, LocList, clean, decode_spec_bytes, spec_error

MAX_YAML_BYTES = 256 * 1024       # a YAML spec is a few KB; pure-Python YAML reads only ~200 KB/s of dense input
MAX_NODES = 10_000                # YAML nodes composed (a 4096-layer `kinds` list is ~4,200)
MAX_DEPTH = 64                    # nesting levels (a spec needs 3)
MAX_EXPANDED_NODES = 200_000      # nodes after expanding aliases and merges

_MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"
_STR_TAG = "tag:yaml.org,2002:str"
_NON_PRINTABLE = yaml.reader.Reader.NON_PRINTABLE


def line_at(text: str, index: int) -> int:
    """1-based line of character `index`, counting line breaks the way PyYAML's marks do."""
    head = text[:index]
    return (head.count("\n") + head.count("\x85") + head.count("\u2028") + head.count("\u2029")
            + head.count("\r") - head.count("\r\n") + 1)


def _short_tag(tag: str | None) -> str:
    if tag and tag.startswith("tag:yaml.org,2002:"):
        return "!!" + tag[len("tag:yaml.org,2002:"):]
    return tag or "?"


class _LocatingSafeLoader(yaml.SafeLoader):
    """SafeLoader whose mappings and sequences carry line numbers, with bounds on size, depth and aliases."""

    spec_file = "<spec>"

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._path: list[str] = []     # field path of the value being constructed (left as is on failure)

    # -- composition bounds --------------------------------------------------------------------------------
    def compose_node(self, parent, index):
        self._nodes += 1
        if self._nodes > MAX_NODES or self._depth >= MAX_DEPTH:
            mark = self.peek_event().start_mark
            what = (f"more than {MAX_NODES} YAML nodes" if self._nodes > MAX_NODES
                    else f"nesting deeper than {MAX_DEPTH} levels")
            raise spec_error(f"{what}; not a model spec", file=self.spec_file, line=mark.line + 1)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        self.root_line = node.start_mark.line + 1
        _check_expansion(node, self.spec_file)
        return self.construct_document(node)

    # -- construction --------------------------------------------------------------------------------------
    def field_path(self) -> str | None:
        out = ""
        for part in self._path:
            out += part if part.startswith("[") or not out else "." + part
        return out or None

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (SpecError, yaml.YAMLError, RecursionError, MemoryError):
            raise
        except (ValueError, OverflowError, ArithmeticError, KeyError, TypeError, AttributeError, IndexError) as exc:
            # a safe constructor choked on a scalar: `!!int abc`, `2024-13-45`, a 5000-digit integer, ...
            value = node.value if isinstance(node, ScalarNode) else node.id
            if "Exceeds the limit" in str(exc) or isinstance(exc, OverflowError):
                reason = "number too large"
            elif isinstance(exc, ValueError):
                reason = clean(str(exc), MAX_SHOWN)
            else:
                reason = "not a valid value of that type"
            raise spec_error(f"cannot read {clean(repr(value), MAX_SHOWN)} as {_short_tag(node.tag)} ({reason})",
                             file=self.spec_file, line=node.start_mark.line + 1, field=self.field_path()) from None


def _children(node) -> list:
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root, file: str) -> None:
    """Refuse self-referencing documents and aliases that expand past MAX_EXPANDED_NODES (no construction yet)."""
    size: dict[int, int] = {}
    visiting: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, post = stack.pop()
        key = id(node)
        if post:
            visiting.discard(key)
            total = 1 + sum(size[id(c)] for c in _children(node))
            if total > MAX_EXPANDED_NODES:
                raise spec_error(f"aliases expand to more than {MAX_EXPANDED_NODES} values (an alias bomb?); "
                                 "a model spec has a few hundred", file=file, line=node.start_mark.line + 1)
            size[key] = total
            continue
        if key in size:
            continue
        if key in visiting:
            raise spec_error("an alias refers to a node that contains it (recursive structure)", file=file,
                             line=node.start_mark.line + 1)
        visiting.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) not in size:
                stack.append((child, False))


def _mapping_pairs(loader: _LocatingSafeLoader, node: MappingNode) -> tuple[list, list]:
    """(merged pairs, lowest precedence first; explicit pairs) of a mapping node, without mutating it."""
    merged: list = []
    own: list = []
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE_TAG:
            if isinstance(value_node, MappingNode):
                sources = [value_node]
            elif isinstance(value_node, SequenceNode):
                sources = list(value_node.value)
            else:
                sources = [value_node]
            for src in reversed(sources):        # earlier sources win: add them last
                if not isinstance(src, MappingNode):
                    raise spec_error(f"a merge key '<<' needs a mapping or a list of mappings, found a {src.id}",
                                     file=loader.spec_file, line=src.start_mark.line + 1, field=loader.field_path())
                sub_merged, sub_own = _mapping_pairs(loader, src)
                merged.extend(sub_merged)
                merged.extend(sub_own)
        else:
            if key_node.tag == _VALUE_TAG:       # a plain '=' key is just the string '='
                key_node = ScalarNode(_STR_TAG, key_node.value, key_node.start_mark, key_node.end_mark)
            own.append((key_node, value_node))
    return merged, own


def _construct_key(loader: _LocatingSafeLoader, key_node) -> str:
    line = key_node.start_mark.line + 1
    if not isinstance(key_node, ScalarNode):
        loader._path.append("?")
        raise spec_error(f"keys must be strings, got a {key_node.id}", file=loader.spec_file, line=line,
                         field=loader.field_path())
    key = loader.construct_object(key_node, deep=True)
    if not isinstance(key, str):
        shown = "null" if key is None else f"{type(key).__name__} {clean(repr(key), MAX_SHOWN)}"
        loader._path.append(clean(key_node.value, MAX_SHOWN) or "null")     # the key as written
        raise spec_error(f"keys must be strings, got {shown} (quote it)", file=loader.spec_file, line=line,
                         field=loader.field_path())
    return key


def _located(loader: _LocatingSafeLoader, node, node_type, container, what: str):
    """An empty `container` (LocDict / LocList) on `node`'s line; a SpecError when `node` is no `node_type`."""
    if not isinstance(node, node_type):
        raise spec_error(f"{_short_tag(node.tag)} needs {what}, found a {node.id}", file=loader.spec_file,
                         line=node.start_mark.line + 1, field=loader.field_path())
    out = container()
    out.line = node.start_mark.line + 1
    return out


def _construct_mapping(loader: _LocatingSafeLoader, node) -> LocDict:
    out = _located(loader, node, MappingNode, LocDict, "a mapping")
    merged, own = _mapping_pairs(loader, node)
    for pairs, explicit in ((merged, False), (own, True)):
        seen: set[str] = set()
        for key_node, value_node in pairs:
            key = _construct_key(loader, key_node)
            line = key_node.start_mark.line + 1
            if explicit:
                if key in seen:
                    loader._path.append(key)
                    raise spec_error(f"duplicate key '{clean(key, MAX_SHOWN)}' (first at line {out.key_lines[key]})",
                                     file=loader.spec_file, line=line, field=loader.field_path())
                seen.add(key)
            loader._path.append(key)
            out[key] = loader.construct_object(value_node, deep=True)
            loader._path.pop()
            out.key_lines[key] = line
    return out


def _construct_sequence(loader: _LocatingSafeLoader, node) -> LocList:
    out = _located(loader, node, SequenceNode, LocList, "a list")
    for i, child in enumerate(node.value):
        loader._path.append(f"[{i}]")
        out.append(loader.construct_object(child, deep=True))
        loader._path.pop()
        out.item_lines.append(child.start_mark.line + 1)
    return out


_LocatingSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LocatingSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


# ---------------------------------------------------------------------------------------------------------------
# YAML 1.2 core schema for plain scalars. PyYAML resolves YAML 1.1, whose traps compile another model without a
# word: `0064` is octal 52, `1:04` is base-60 64, `yes`/`on` are booleans, and `1e-5` (no dot) is a string. Here
# bools are true/false only (yes/no/on/off are strings, which the schema then refuses with a hint), ints are
# decimal, 0o octal or 0x hex, floats need no dot, and a decimal with leading zeros is refused rather than guessed.
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_CORE_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_CORE_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_CORE_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                         r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_LEADING_ZEROS = re.compile(r"^[-+]?0[0-9]+$")

_LocatingSafeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_LocatingSafeLoader.add_implicit_resolver(_BOOL_TAG, _CORE_BOOL, list("tTfF"))
_LocatingSafeLoader.add_implicit_resolver(_INT_TAG, _CORE_INT, list("-+0123456789"))       # before floats: 64 is an int
_LocatingSafeLoader.add_implicit_resolver(_FLOAT_TAG, _CORE_FLOAT, list("-+.0123456789"))


def leading_zeros_message(text: str) -> str:
    """Why `0064` is refused: YAML 1.2 reads it as 64, YAML 1.1 (and so many tools) as octal 52."""
    sign = "-" if text.startswith("-") else ""
    digits = text.lstrip("+-")
    decimal = f"{sign}{int(digits, 10)}"
    if all(c in "01234567" for c in digits):
        octal = f"{sign}{int(digits, 8)}"
        return (f"leading zeros: write {decimal} (YAML 1.1 would read {clean(text, MAX_SHOWN)} as octal {octal}; "
                f"write 0o{digits.lstrip('0') or '0'} if you meant octal)")
    return f"leading zeros: write {decimal} (or quote it if it is text)"


def _construct_core_int(loader: _LocatingSafeLoader, node) -> int:
    text = loader.construct_scalar(node)
    if not isinstance(text, str) or not _CORE_INT.match(text):
        raise ValueError("not a YAML 1.2 integer (decimal, 0o octal or 0x hex)")
    if _LEADING_ZEROS.match(text):
        raise spec_error(leading_zeros_message(text), file=loader.spec_file, line=node.start_mark.line + 1,
                         field=loader.field_path())
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text, 10)


def _construct_core_float(loader: _LocatingSafeLoader, node) -> float:
    text = loader.construct_scalar(node)
    if not isinstance(text, str) or not (_CORE_FLOAT.match(text) or _CORE_INT.match(text)):
        raise ValueError("not a YAML 1.2 number")
    low = text.lower()
    if low.endswith(".inf"):
        return -math.inf if low.startswith("-") else math.inf
    if low == ".nan":
        return math.nan
    if text.startswith(("0o", "0x")):
        return float(_construct_core_int(loader, node))
    return float(text)


def _construct_core_bool(loader: _LocatingSafeLoader, node) -> bool:
    text = loader.construct_scalar(node)
    if not isinstance(text, str) or not _CORE_BOOL.match(text):
        raise ValueError("a YAML 1.2 boolean is true or false")
    return text.lower() == "true"


_LocatingSafeLoader.add_constructor(_INT_TAG, _construct_core_int)
_LocatingSafeLoader.add_constructor(_FLOAT_TAG, _construct_core_float)
_LocatingSafeLoader.add_constructor(_BOOL_TAG, _construct_core_bool)


class SpecDumper(yaml.SafeDumper):
    """SafeDumper that also quotes strings YAML 1.2 (how specs are read) would take as numbers or booleans (`1e5`,
    `0o17`), besides those YAML 1.1 would (`0064`, `yes`)."""


SpecDumper.add_implicit_resolver(_BOOL_TAG, _CORE_BOOL, list("tTfF"))
SpecDumper.add_implicit_resolver(_INT_TAG, _CORE_INT, list("-+0123456789"))
SpecDumper.add_implicit_resolver(_FLOAT_TAG, _CORE_FLOAT, list("-+.0123456789"))


def dump_yaml_text(data: dict) -> str:
    """Plain spec data as YAML text that load_yaml_text reads back to the same data."""
    return yaml.dump(data, Dumper=SpecDumper, sort_keys=False, default_flow_style=None, width=120)


# ---------------------------------------------------------------------------------------------------------------
_HINTS = (
    ("cannot start any token", "'\\t'", "tabs cannot indent YAML; use spaces"),
    ("mapping values are not allowed here", "", "check the indentation, or quote a value that contains ': '"),
    ("could not find expected ':'", "", "check the indentation, or close the quote / bracket"),
)


def _yaml_error_message(exc: yaml.MarkedYAMLError) -> tuple[str, int | None]:
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else None
    problem = str(exc.problem or exc.context or "invalid YAML")
    if "python/" in problem or "could not determine a constructor" in problem:
        tag = problem.split("for the tag")[-1].strip().replace("tag:yaml.org,2002:", "!!") or "unknown tag"
        return f"tag {tag} is not allowed in a spec (only plain YAML data)", line
    message = f"YAML error: {problem}"
    if exc.problem and exc.context and problem.startswith("but found another document"):
        return "YAML error: a spec is a single YAML document, but found a second one ('---')", line
    if exc.problem and exc.context:
        ctx = str(exc.context)
        if exc.context_mark is not None and (mark is None or exc.context_mark.line != mark.line):
            ctx += f" started at line {exc.context_mark.line + 1}"
        message += f" ({ctx})"
    for needle, also, hint in _HINTS:
        if needle in problem and also in problem:
            message += f"; {hint}"
    return message, line


def load_yaml_text(text: str | bytes, file: str) -> LocDict:
    """Parse spec text into a LocDict; raise SpecError with file and line on any problem."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = decode_spec_bytes(bytes(text), file)
    if not isinstance(text, str):
        raise TypeError(f"spec text must be str or bytes, not {type(text).__name__}")
    if len(text) > MAX_YAML_BYTES or (len(text) > MAX_YAML_BYTES // 4
                                      and len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES):
        raise spec_error(f"file is larger than {MAX_YAML_BYTES} bytes; a YAML spec is a few KB", file=file)
    bad = _NON_PRINTABLE.search(text)
    if bad is not None:
        ch = bad.group()
        what = "NUL byte" if ch == "\x00" else f"character U+{ord(ch):04X}"
        raise spec_error(f"{what} at column {bad.start() - max(text.rfind(chr(10), 0, bad.start()), -1)} is not "
                         "allowed in YAML (binary data?)", file=file, line=line_at(text, bad.start()))

    loader = type("_Loader", (_LocatingSafeLoader,), {"spec_file": file})(text)   # SafeLoader: safe types only
    try:
        data = loader.get_single_data()
    except SpecError:
        raise
    except yaml.MarkedYAMLError as exc:
        message, line = _yaml_error_message(exc)
        raise spec_error(message, file=file, line=line, field=loader.field_path()) from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise spec_error(f"YAML error: {first}", file=file) from None
    except RecursionError:
        raise spec_error("YAML nesting too deep", file=file, field=loader.field_path()) from None
    except MemoryError:
        raise spec_error("out of memory while loading; not a model spec", file=file) from None
    finally:
        loader.dispose()
    if data is None:
        raise spec_error("spec is empty (no YAML content, only blank lines or comments)", file=file, line=1)
    if not isinstance(data, LocDict):
        kind = {"LocList": "a list", "str": "a string", "int": "an integer", "float": "a number",
                "bool": "a boolean"}.get(type(data).__name__, type(data).__name__)
        raise spec_error(f"top level must be a mapping of sections (name, model, layers, ...), got {kind}",
                         file=file, line=getattr(loader, "root_line", 1))
    return data
