"""Tool calls, structured outputs, logit changes and /tokenize through the official `openai` client against a real
`k3c serve` of the trained example model (which has never seen a tool call or JSON: the grammar does the work)."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest

pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from .test_serve import KEY, server  # noqa: E402,F401 - test_serve's module-scoped server fixture, one per module

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from structured_outputs import random_schema  # noqa: E402

M = "k3-stdlib"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _tools(schema, decoy):
    return [{"type": "function", "function": {"name": "pick", "description": "the one", "parameters": schema}},
            {"type": "function", "function": {"name": "other", "parameters": decoy}}]


def test_forced_tool_calls_validate_and_stream_like_whole(client):
    rng = random.Random(5)
    schemas = [(random_schema(rng), random_schema(rng)) for _ in range(4)]
    for i, (schema, decoy) in enumerate(schemas):
        req = dict(model=M, messages=[{"role": "user", "content": "Use a tool."}], tools=_tools(schema, decoy),
                   tool_choice="required", parallel_tool_calls=False, max_tokens=384,
                   **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i}))
        r = client.chat.completions.create(**req)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id == f"functions.{call.function.name}:0"
        jsonschema.validate(json.loads(call.function.arguments), schema if call.function.name == "pick" else decoy)
        if i == 0:                                        # greedy: the stream says the same, in OpenAI's shape
            chunks = list(client.chat.completions.create(stream=True, **req))
            deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
            assert deltas[0].id == call.id and deltas[0].function.name == call.function.name
            assert all(d.id is None and d.index == 0 for d in deltas[1:])
            assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
            assert [ch.choices[0].finish_reason for ch in chunks][-1] == "tool_calls"
            assert not any(ch.choices[0].delta.content for ch in chunks)


def test_named_tool_choice(client):
    rng = random.Random(6)
    schema, decoy = random_schema(rng), random_schema(rng)
    r = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}],
                                       tools=_tools(schema, decoy), max_tokens=384, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "other"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "other"
    jsonschema.validate(json.loads(call.function.arguments), decoy)


def test_json_schema_and_json_object(client):
    rng = random.Random(7)
    for i in range(3):
        schema = random_schema(rng)
        r = client.chat.completions.create(
            model=M, messages=[{"role": "user", "content": "JSON please"}], max_tokens=256,
            response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}},
            **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}))
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}], max_tokens=128,
                                       temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                                                 # cut by max_tokens: a prefix of an object
        assert r.choices[0].message.content.startswith("{")


def test_auto_tool_choice_text_or_valid_calls(client):
    """tool_choice "auto" (the default with tools): the model answers text or calls; calls are schema-valid (the
    grammar takes over once a section begins: tests/runtime/test_speculative_grammar.py starts one); streamed and
    whole outputs agree."""
    rng = random.Random(8)
    schema, decoy = random_schema(rng), random_schema(rng)
    req = dict(model=M, messages=[{"role": "user", "content": "What is the weather? Use a tool if you need."}],
               tools=_tools(schema, decoy), max_tokens=48, temperature=0)
    r = client.chat.completions.create(**req)
    c = r.choices[0]
    for call in c.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), schema if call.function.name == "pick" else decoy)
    assert c.finish_reason == ("tool_calls" if c.message.tool_calls else c.finish_reason)
    chunks = list(client.chat.completions.create(stream=True, **req))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == (c.message.content or "")
    assert chunks[-1].choices[0].finish_reason == c.finish_reason


def test_a_tool_conversation_renders_and_tokenize_agrees(client, server):
    tools = _tools({"type": "object", "properties": {"q": {"type": "string"}}}, {"type": "object"})
    messages = [{"role": "user", "content": "find x"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "functions.pick:0", "type": "function",
                     "function": {"name": "pick", "arguments": "{\"q\": \"x \\\"quoted\\\"\"}"}}]},
                {"role": "tool", "tool_call_id": "functions.pick:0", "content": "found it"}]
    r = client.chat.completions.create(model=M, messages=messages, tools=tools, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    status, tok = server.post("/tokenize", json.dumps({"model": M, "messages": messages, "tools": tools}).encode())
    assert status == 200 and tok["count"] == r.usage.prompt_tokens == len(tok["tokens"])
    status, text = server.post("/detokenize", json.dumps({"tokens": tok["tokens"]}).encode())
    assert status == 200 and "<|tool_call_begin|>functions.pick:0" in text["prompt"]
    assert "## Return of functions.pick:0\nfound it" in text["prompt"]


def test_logit_bias_and_penalties(client, server):
    _, tok = server.post("/tokenize", json.dumps({"prompt": "x"}).encode())
    (x,) = tok["tokens"]
    r = client.completions.create(model=M, prompt="import os\n", max_tokens=4, temperature=0,
                                  logit_bias={str(x): 100})
    assert r.choices[0].text == "xxxx"
    plain = client.completions.create(model=M, prompt="import os\n", max_tokens=32, temperature=0)
    penalized = client.completions.create(model=M, prompt="import os\n", max_tokens=32, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.0)
    assert penalized.choices[0].text != plain.choices[0].text


def test_usage_on_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    used = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert used == sorted(used) and used[-1] == 6 and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a"}}], "tool_choice":
      {"type": "function", "function": {"name": "b"}}}, "tool_choice.function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"logit_bias": {"99999": 1}}, "logit_bias.99999"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_tool_and_format_fields(server, extra, param):
    body = {"model": M, "messages": [{"role": "user", "content": "x"}], **extra}
    status, err = server.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, err
    assert err["error"]["param"] == param


def test_tokenize_refusals(server):
    assert server.post("/tokenize", b'{"prompt": 5}')[0] == 400
    assert server.post("/detokenize", b'{"tokens": [99999]}')[1]["error"]["param"] == "tokens"
    assert server.post("/tokenize", b'{"prompt": "x"}', key=None)[0] == 401


def test_metrics_with_vllms_semantics(client, server):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}], max_tokens=32,
                                       temperature=0, response_format={"type": "json_schema", "json_schema": {
                                           "name": "b", "schema": schema}})
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].message.content)["a"] in (True, False)
    m = server.metrics()
    assert m["k3c_request_queue_time_seconds_count"] >= 1 and m["k3c_request_queue_time_seconds_sum"] >= 0
    assert 0 < m["k3c_kv_cache_usage"] <= 1                          # checkpoints hold pages after requests
    assert m["k3c_kv_cache_usage"] == m["k3c_kv_pages_used"] / m["k3c_kv_pages_total"]
    assert m["k3c_choices_finished_total{reason=stop}"] >= 1          # grammars that completed
    assert m["k3c_prompt_tokens_cached_total"] <= m["k3c_prompt_tokens_total"]


def test_health_is_503_while_the_model_loads():
    import re
    import subprocess
    import time
    import urllib.error
    import urllib.request

    from .test_serve import MODEL, ROOT

    # probed in the window between the "loading" line and the "listening" line (the build takes seconds)
    proc = subprocess.Popen([sys.executable, "-m", "k3c.cli", "serve", MODEL, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        url = re.search(r"(http://\S+) answers 503", line).group(1)
        try:
            urllib.request.urlopen(url + "/health", timeout=30)
            status, body = 200, None
        except urllib.error.HTTPError as e:
            status, body = e.code, json.loads(e.read())
        assert (status, body) == (503, {"status": "loading"})
        while "listening on" not in line:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
        deadline = time.time() + 30
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert r.status == 200 and time.time() < deadline
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
