"""The grammars of constrained decoding on the example model's tokenizer: what they accept and refuse."""
import time

import pytest
import torch

from k3c.runtime.logits_processors import unpack_bitmask
from k3c.runtime.text import load_tokenizer
from k3c.serve.api_error import APIError
from k3c.serve.grammar import Grammars

pytest.importorskip("xgrammar")

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
             "required": ["city", "unit"], "additionalProperties": False}},
         {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
                                        "required": ["a"], "additionalProperties": False}}]
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def call(name, k, args):
    return f"<|tool_call_begin|>functions.{name}:{k}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


@pytest.fixture(scope="module")
def grammars():
    return Grammars(load_tokenizer("examples/k3-stdlib"))


def accepts(grammars, g, text) -> bool:
    c = g.matcher()
    for t in grammars._tokenizer.encode(text):
        mask = torch.zeros(1, 128, dtype=torch.int32)
        c.fill_mask(mask, 0)
        if not unpack_bitmask(mask, 4096)[0, t]:
            return False
        c.accept(t)
    c.accept(grammars._tokenizer.eos_id)
    return c.finished


def test_tool_call_grammar(grammars):
    g = grammars.tool_call(TOOLS)
    two = SB + call("get_weather", 0, '{"city":"Oslo","unit":"c"}') + call("add", 1, '{"a":3}') + SE
    assert accepts(grammars, g, two)
    assert not accepts(grammars, g, SB + call("add", 1, '{"a":3}') + SE)          # the first call is :0
    assert not accepts(grammars, g, SB + call("add", 0, '{"a":10}') + SE)         # past the maximum
    assert not accepts(grammars, g, SB + call("add", 0, '{"a": 3}') + SE)         # compact JSON only
    assert not accepts(grammars, g, SB + call("nope", 0, '{}') + SE)
    one = grammars.tool_call(TOOLS, parallel=False)
    assert not accepts(grammars, one, two)
    named = grammars.tool_call(TOOLS, name="add")
    assert accepts(grammars, named, SB + call("add", 0, '{"a":3}') + SE)
    assert not accepts(grammars, named, SB + call("get_weather", 0, '{"city":"x","unit":"f"}') + SE)


def test_json_schema_grammar_and_bounded_strings_are_fast(grammars):
    t0 = time.perf_counter()
    g = grammars.json_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 100}},
                              "required": ["s"]}, "p")
    c = g.matcher()
    c.fill_mask(torch.zeros(1, 128, dtype=torch.int32), 0)
    assert time.perf_counter() - t0 < 5        # llguidance took 6 s on maxLength 20 (grammar.py)
    assert accepts(grammars, g, '{"s":"abc"}')
    assert not accepts(grammars, g, '{"t":"x"}')
    free = grammars.json_schema({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}, "p")
    assert accepts(grammars, free, '{"s":"ab\\"c\\\\"}')      # escapes (xgrammar drops them under a maxLength)
    assert accepts(grammars, grammars.json_object(), '{"any":[1,{"b":null}]}')


def test_a_schema_it_cannot_use_is_a_400_naming_the_field(grammars):
    with pytest.raises(APIError) as e:
        grammars.json_schema({"type": 5}, "response_format.json_schema.schema")
    assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema"


def test_auto_tool_choice_grammar(grammars):
    """Text, or text and then a section of valid calls (K2's marker or its singular spelling), then the end."""
    g = grammars.tool_call_auto(TOOLS)
    good = SB + call("get_weather", 0, '{"city":"Oslo","unit":"c"}') + call("add", 1, '{"a":3}') + SE
    assert accepts(grammars, g, "Just text, no call: {a} <b> | : functions.add")
    assert accepts(grammars, g, "<think>thinking</think>Let me check." + good)
    assert accepts(grammars, g, good)
    singular = "<|tool_call_section_begin|>" + call("add", 0, '{"a":3}') + "<|tool_call_section_end|>"
    assert accepts(grammars, g, singular)
    assert not accepts(grammars, g, "x" + SB + call("add", 0, '{"a":10}') + SE)     # a started call is schema-valid
    assert not accepts(grammars, g, SB + call("add", 1, '{"a":3}') + SE)             # numbered from :0
    assert not accepts(grammars, g, SB + call("nope", 0, '{}') + SE)
    assert not accepts(grammars, g, SB + SE)                                          # a section holds a call
    assert not accepts(grammars, g, good + "more text")                               # the section ends the output
    assert not accepts(grammars, g, "x" + call("add", 0, '{"a":3}'))                  # no call outside a section
    assert not accepts(grammars, g, "cut off" + SB)                                   # EOS inside a section
    one = grammars.tool_call_auto(TOOLS, parallel=False)
    assert not accepts(grammars, one, good)
    assert grammars.tool_call_auto(TOOLS) is g                                       # compiled once per tool set


def test_tool_fields_constrain_auto_unless_the_format_does(grammars):
    from k3c.serve.tools import parse_tool_fields

    tools = [{"type": "function", "function": t} for t in TOOLS]
    auto = parse_tool_fields({"tools": tools}, grammars)
    assert auto.choice == "auto" and auto.grammar is grammars.tool_call_auto(list(auto.tools))
    assert accepts(grammars, auto.grammar, "text, then " + SB + call("add", 0, '{"a":3}') + SE)
    fmt = parse_tool_fields({"tools": tools, "response_format": {"type": "json_object"}}, grammars)
    assert fmt.choice == "auto" and accepts(grammars, fmt.grammar, '{"a":1}')
    assert not accepts(grammars, fmt.grammar, "text")
    assert parse_tool_fields({"tools": tools, "tool_choice": "none"}, grammars).grammar is None


def test_batch_fill_equals_row_by_row(grammars):
    from k3c.runtime.logits_processors import fill_masks

    gs = [grammars.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "p"),
          grammars.tool_call(TOOLS), grammars.tool_call_auto(TOOLS), grammars.json_object()]
    cs = [g.matcher() for g in gs]
    for c, text in zip(cs, ['{"a":', SB + "<|tool_call_begin|>functions.", "some text ", '{"k":[1,']):
        for t in grammars._tokenizer.encode(text):
            c.accept(t)
        assert not c.failed
    batch = torch.zeros(len(cs), 128, dtype=torch.int32)
    fill_masks(cs, batch)
    rows = torch.zeros(len(cs), 128, dtype=torch.int32)
    for j, c in enumerate(cs):
        c.fill_mask(rows, j)
    assert torch.equal(batch, rows) and len({tuple(r.tolist()) for r in rows}) == len(cs)
