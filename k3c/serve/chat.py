"""Chat messages -> the prompt text the model continues.

    template = ChatTemplate.from_directory("examples/k3-stdlib", eos_token="<|endoftext|>")
    text = template.render([{"role": "user", "content": "hi"}])

A model directory's `tokenizer_config.json` may carry a Jinja `chat_template` (a string, or a list of
{"name", "template"} entries of which "default" is taken), as Hugging Face tokenizers do; it is rendered in
Jinja's immutable sandbox (a template is data from a file: it may not reach Python attributes or change state)
with `messages`, `tools` (OpenAI's tool list, or None), `add_generation_prompt=True`, `bos_token` and
`eos_token`. Without one:
- a conversation with tools offered, tool calls or tool results is rendered by K2_TEMPLATE, Kimi K2's format
  (`<|im_system|>tool_declare<|im_middle|>` + the tools as JSON, each turn `<|im_ROLE|>ROLE<|im_middle|>...
  <|im_end|>`, an assistant's calls as a `<|tool_calls_section_begin|>` section, a tool's result as
  `## Return of ID`), in the same sandbox;
- any other conversation by the plain default

    <role>: <content>\\n        one line group per message, in order
    assistant:                 the turn the model writes (no trailing space)

  so a model trained on plain text (the example model) sees a transcript it can continue.
"""
from __future__ import annotations

import json
import os

from ..errors import ArgumentError
from ..outputs import loads_json
from ..runtime.text import TOKENIZER_CONFIG

PLAIN = "plain"
K2 = "k2 (built in)"

# Kimi K2's chat template (its tokenizer_config.json's), the tool-call parts verbatim; the system default of a
# conversation without a system message is left out (it names a product)
K2_TEMPLATE = """\
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- set role = message['role'] -%}
{%- if role == 'system' or role == 'developer' -%}<|im_system|>system<|im_middle|>
{%- elif role == 'user' -%}<|im_user|>user<|im_middle|>
{%- elif role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
{%- else -%}<|im_system|>tool<|im_middle|>
{%- endif -%}
{%- if role == 'assistant' and message.get('tool_calls') -%}
{{ message['content'] or '' }}<|tool_calls_section_begin|>
{%- for call in message['tool_calls'] -%}
<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>{{ call['function']['arguments'] }}<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- elif role == 'tool' -%}
## Return of {{ message['tool_call_id'] }}
{{ message['content'] }}
{%- else -%}
{{ message['content'] }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""


def _plain(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _compile(source: str, origin: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):         # what Hugging Face templates call to refuse a conversation
        raise ValueError(str(message))

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Hugging Face's tojson: no HTML escaping (Jinja's own escapes <, > and &), keys in order
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ArgumentError(f"{origin}: chat_template is not a valid Jinja template ({exc})") from None


def _uses_tools(messages: list[dict], tools) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str | None = None, eos_token: str | None = None,
                 origin: str = PLAIN):
        self.origin = origin                     # the file the template came from, or "plain"
        self._tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template = _compile(source, origin) if source is not None else None
        self._k2 = None                          # K2_TEMPLATE, compiled on first use (no template of its own)

    @classmethod
    def from_directory(cls, directory: str | None, *, eos_token: str | None = None) -> ChatTemplate:
        """The template of a model directory or artifact's tokenizer_config.json; the plain default without one."""
        path = os.path.join(directory, TOKENIZER_CONFIG) if directory else None
        if path is None or not os.path.isfile(path):
            return cls(None)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ArgumentError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        config = loads_json(data, path, error=ArgumentError)
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):             # named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return cls(None)
        if not isinstance(source, str):
            raise ArgumentError(f"{path}: chat_template must be a string or a list of named templates")
        bos = config.get("bos_token")
        return cls(source, bos_token=bos if isinstance(bos, str) else None, eos_token=eos_token, origin=path)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text of `messages` (checked by protocol.parse_chat: role and string content each) with
        `tools` offered (OpenAI's tool list; None: none)."""
        template = self._template
        if template is None:
            if not _uses_tools(messages, tools):
                return _plain(messages)
            if self._k2 is None:
                self._k2 = _compile(K2_TEMPLATE, K2)
            template = self._k2
        from jinja2 import TemplateError

        from .protocol import APIError

        try:
            return template.render(messages=messages, tools=tools, add_generation_prompt=True, **self._tokens)
        except (TemplateError, ValueError, TypeError) as exc:
            raise APIError(400, f"messages: the model's chat template refused them ({str(exc)[:200]})",
                           param="messages") from None
