"""The chat API's tool and structured-output fields, checked: tools, tool_choice, parallel_tool_calls,
response_format, and the grammar they call for.

    fields = parse_tool_fields(body, grammars)     # ToolFields; APIError (400) naming the field otherwise

- `tools`: at most MAX_TOOLS functions, each {"type": "function", "function": {"name", "description"?,
  "parameters"? (a JSON schema object), "strict"?}}; names of 1-64 letters, digits, "_" or "-", no two alike.
- `tool_choice`: "none" (tools are not offered: the template does not render them and nothing is parsed), "auto"
  (the default with tools: the model decides between text and calls; its output is parsed for K2 tool calls and,
  once it begins a tool-call section, constrained to calls of the tools with valid arguments: unless
  response_format constrains the output), "required" (constrained:
  a K2 tool-call section of one or more calls, each call's arguments valid against its function's parameters) or
  {"type": "function", "function": {"name": N}} (constrained to a call of N). `parallel_tool_calls: false`
  allows one call.
- `response_format`: {"type": "text"}, {"type": "json_object"} (constrained to a JSON object) or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}} (constrained to the
  schema, strict or not). Not together with a forced tool call.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .api_error import field_error, json_kind

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolFields:
    tools: tuple[dict, ...] = ()     # {"name", "description", "parameters"} each, as the chat template gets them
    choice: str = "none"             # none | auto | required | named
    named: str | None = None
    grammar: object = None           # grammar.Grammar constraining the output, or None
    parse_calls: bool = False        # parse the output for K2 tool calls

    def template_tools(self) -> list[dict] | None:
        """tools as chat templates take them (OpenAI's shape), None when not offered."""
        if self.choice == "none" or not self.tools:
            return None
        return [{"type": "function", "function": t} for t in self.tools]


def _object(v, param: str) -> dict:
    if not isinstance(v, dict):
        raise field_error(param, f"expected an object, got {json_kind(v)}")
    return v


def _keys(v: dict, param: str, known: set) -> None:
    for k in v:
        if k not in known:
            raise field_error(f"{param}.{str(k)[:64]}", "unrecognized argument", code="unrecognized_argument")


def _tools(body: dict) -> tuple[dict, ...]:
    v = body.get("tools")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise field_error("tools", f"expected an array, got {json_kind(v)}")
    if len(v) > MAX_TOOLS:
        raise field_error("tools", f"at most {MAX_TOOLS} tools, got {len(v)}")
    out, seen = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        _keys(_object(t, where), where, {"type", "function"})
        if t.get("type") != "function":
            raise field_error(f"{where}.type", f"must be \"function\", got {str(t.get('type'))[:64]!r}")
        f = _object(t.get("function"), f"{where}.function")
        _keys(f, f"{where}.function", {"name", "description", "parameters", "strict"})
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise field_error(f"{where}.function.name", "must be 1-64 letters, digits, underscores or dashes")
        if name in seen:
            raise field_error(f"{where}.function.name", f"{name!r} names two tools")
        seen.add(name)
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise field_error(f"{where}.function.description", f"expected a string, got {json_kind(desc)}")
        params = f.get("parameters")
        if params is not None:
            _object(params, f"{where}.function.parameters")
        if f.get("strict") is not None and not isinstance(f.get("strict"), bool):
            raise field_error(f"{where}.function.strict", f"expected a boolean, got {json_kind(f.get('strict'))}")
        out.append({"name": name, **({"description": desc} if desc else {}),
                    "parameters": params if params is not None else {"type": "object", "properties": {}}})
    return tuple(out)


def _choice(body: dict, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    v = body.get("tool_choice")
    if v is None:
        return ("auto" if tools else "none"), None
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise field_error("tool_choice", f"must be none, auto, required or a function, got {v[:64]!r}")
        if v != "none" and not tools:
            raise field_error("tool_choice", f"{v!r} needs tools")
        return v, None
    f = _object(v, "tool_choice")
    if f.get("type") != "function" or not isinstance(f.get("function"), dict):
        raise field_error("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
    name = f["function"].get("name")
    if not isinstance(name, str) or name not in {t["name"] for t in tools}:
        raise field_error("tool_choice.function.name", f"names no tool of this request: {str(name)[:64]!r}")
    return "named", name


def _response_format(body: dict, grammars):
    v = body.get("response_format")
    if v is None:
        return None
    f = _object(v, "response_format")
    kind = f.get("type")
    if kind == "text":
        _keys(f, "response_format", {"type"})
        return None
    if kind == "json_object":
        _keys(f, "response_format", {"type"})
        return grammars.json_object()
    if kind == "json_schema":
        _keys(f, "response_format", {"type", "json_schema"})
        js = _object(f.get("json_schema"), "response_format.json_schema")
        _keys(js, "response_format.json_schema", {"name", "schema", "strict", "description"})
        name = js.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise field_error("response_format.json_schema.name",
                              "required: 1-64 letters, digits, underscores or dashes")
        if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
            raise field_error("response_format.json_schema.strict",
                              f"expected a boolean, got {json_kind(js.get('strict'))}")
        schema = js.get("schema", {})
        _object(schema, "response_format.json_schema.schema")
        return grammars.json_schema(schema, "response_format.json_schema.schema")
    raise field_error("response_format.type", f"must be text, json_object or json_schema, got {str(kind)[:64]!r}")


def parse_tool_fields(body: dict, grammars) -> ToolFields:
    """The request's tool and output-format fields (module docstring); `grammars` compiles their grammar."""
    for name in ("functions", "function_call"):    # the API's deprecated spellings
        if body.get(name) is not None:
            raise field_error(name, f"deprecated: send {'tools' if name == 'functions' else 'tool_choice'} instead",
                       code="unsupported_parameter")
    tools = _tools(body)
    choice, named = _choice(body, tools)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise field_error("parallel_tool_calls", f"expected a boolean, got {json_kind(parallel)}")
    forced = choice in ("required", "named")
    if grammars is None:                           # a server without a tokenizer: no grammar can be compiled
        wants = "tool_choice" if forced else "response_format" if body.get("response_format") not in \
            (None, {"type": "text"}) else None
        if wants:
            raise field_error(wants, "constrained decoding needs the model's tokenizer, which this server lacks",
                       code="unsupported_parameter")
        return ToolFields(tools=tools, choice=choice, named=named, parse_calls=choice != "none")
    grammar = _response_format(body, grammars)
    if forced:
        if grammar is not None:
            raise field_error("response_format",
                              f"not together with tool_choice {choice if choice != 'named' else named!r}")
        grammar = grammars.tool_call(list(tools), named, parallel)
    elif choice == "auto" and grammar is None:
        grammar = grammars.tool_call_auto(list(tools), parallel)
    return ToolFields(tools=tools, choice=choice, named=named, grammar=grammar, parse_calls=choice != "none")
