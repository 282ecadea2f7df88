"""Chat messages -> the prompt text the model continues.

    template = ChatTemplate.from_directory("examples/k3-stdlib", eos_token="<|endoftext|>")
    text = template.render([{"role": "user", "content": "hi"}])

A model directory's `tokenizer_config.json` may carry a Jinja `chat_template` (a string, or a list of
{"name", "template"} entries of which "default" is taken), as Hugging Face tokenizers do; it is rendered in
Jinja's immutable sandbox (a template is data from a file: it may not reach Python attributes or change state)
with `messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`. Without one, the plain default:

    <role>: <content>\\n        one line group per message, in order
    assistant:                 the turn the model writes (no trailing space)

so a model trained on plain text (the example model) sees a transcript it can continue.
"""
from __future__ import annotations

import os

from ..errors import ArgumentError
from ..outputs import loads_json
from ..runtime.text import TOKENIZER_CONFIG

PLAIN = "plain"


def _plain(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str | None = None, eos_token: str | None = None,
                 origin: str = PLAIN):
        self.origin = origin                     # the file the template came from, or "plain"
        self._tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template = None
        if source is not None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message):         # what Hugging Face templates call to refuse a conversation
                raise ValueError(str(message))

            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(source)
            except TemplateError as exc:
                raise ArgumentError(f"{origin}: chat_template is not a valid Jinja template ({exc})") from None

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

    def render(self, messages: list[dict]) -> str:
        """The prompt text of `messages` (checked by protocol.parse_chat: role and string content each)."""
        if self._template is None:
            return _plain(messages)
        from jinja2 import TemplateError

        from .protocol import APIError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._tokens)
        except (TemplateError, ValueError, TypeError) as exc:
            raise APIError(400, f"messages: the model's chat template refused them ({str(exc)[:200]})",
                           param="messages") from None
