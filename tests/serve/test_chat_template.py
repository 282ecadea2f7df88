"""serve/chat.py: a model directory's Jinja chat template, rendered in the immutable sandbox."""
import json

import pytest

from k3c.errors import ArgumentError
from k3c.serve.chat import ChatTemplate
from k3c.serve.protocol import APIError

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _dir(tmp_path, template):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    return str(tmp_path)


def test_directory_template_is_rendered(tmp_path):
    t = ChatTemplate.from_directory(_dir(tmp_path, TEMPLATE), eos_token="</s>")
    assert t.origin.endswith("tokenizer_config.json")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert t.render(msgs) == "<s><|system|>be brief</s><|user|>hi</s><|assistant|>"


def test_named_templates_take_default(tmp_path):
    t = ChatTemplate.from_directory(_dir(tmp_path, [{"name": "tool_use", "template": "x"},
                                                    {"name": "default", "template": TEMPLATE}]))
    assert t.render([{"role": "user", "content": "a"}]) == "<s><|user|>a<|assistant|>"


def test_plain_default_without_a_template(tmp_path):
    t = ChatTemplate.from_directory(str(tmp_path))
    assert t.origin == "plain"
    assert t.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == \
        "user: a\nassistant: b\nassistant:"


def test_template_cannot_mutate_or_escape(tmp_path):
    t = ChatTemplate.from_directory(_dir(tmp_path, "{{ messages.append(1) }}"))
    with pytest.raises(APIError) as err:
        t.render([{"role": "user", "content": "a"}])
    assert err.value.status == 400 and err.value.param == "messages"
    leak = ChatTemplate.from_directory(_dir(tmp_path, "{{ ''.__class__.__mro__ }}"))
    with pytest.raises(APIError):
        leak.render([{"role": "user", "content": "a"}])


def test_template_refusal_and_bad_template(tmp_path):
    t = ChatTemplate.from_directory(_dir(tmp_path, "{{ raise_exception('only user turns') }}"))
    with pytest.raises(APIError, match="only user turns"):
        t.render([{"role": "user", "content": "a"}])
    with pytest.raises(ArgumentError, match="not a valid Jinja template"):
        ChatTemplate.from_directory(_dir(tmp_path, "{% for %}"))
