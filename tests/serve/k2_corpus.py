"""A corpus of Kimi-K2-format outputs (tool calls and reasoning) with what a parser must make of them.

Each case is (name, text, expected) with expected = {"content", "reasoning_content", "tool_calls": [{"id", "name",
"arguments"}]}. The well-formed cases are assembled from their parts (so the expected value is known without any
parser); the malformed and truncated ones are written out by hand, in the shapes models produce (the vLLM and
SGLang bug reports on Kimi parsers: a missing </think>, missing end markers, calls cut off mid-header).
"""
from __future__ import annotations

import json
import random

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

_NAMES = ["get_weather", "search", "read_file", "run_sql", "send-email", "calc_2", "lookup"]
_ARGS = [
    {"city": "Paris"}, {"query": "he said \"hi\" and left", "limit": 3}, {"path": "C:\\\\dir\\\\f.txt"},
    {"sql": "SELECT * FROM t WHERE a < 3 AND b > 'x'"}, {"to": ["a@b.c"], "body": "line1\nline2\t<tab>"},
    {"expr": "2*(3+4)", "precise": True}, {"nested": {"a": [1, 2, {"b": None}], "c": -1.5e3}}, {},
    {"text": "unicode: 東京 ✓ \u00e9", "markers": "<|not_a_marker|> <think>"},
]
_REASON = ["", "The user wants the weather. I will call the tool.", "Let me think.\nStep 1: parse.\nStep 2: call.",
           "Need two calls: search then read."]
_CONTENT = ["", "Sure, let me check.", "I'll look that up for you.\n", "Calling tools now: "]


def _call(name: str, idx: int, args: dict, spaced: bool) -> tuple[str, dict]:
    arg = json.dumps(args, ensure_ascii=False, separators=None if spaced else (",", ":"))
    hid = f"functions.{name}:{idx}"
    return f"{CB}{hid}{AB}{arg}{CE}", {"id": hid, "name": name, "arguments": arg}


def _well_formed(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        reasoning = rng.choice(_REASON)
        content = rng.choice(_CONTENT)
        ncalls = rng.choice([0, 1, 1, 2, 3])
        text = f"<think>{reasoning}</think>" if reasoning or k % 5 == 0 else ""
        if k % 7 == 0 and text:
            text = "\n" + text                 # whitespace before <think>
        text += content
        calls = []
        if ncalls:
            text += SB + ("\n" if k % 2 else "")
            for i in range(ncalls):
                t, c = _call(rng.choice(_NAMES), i, rng.choice(_ARGS), spaced=k % 3 == 0)
                text += t + ("\n" if k % 4 == 1 else "")
                calls.append(c)
            text += SE
        elif not content:
            content = "Plain answer."
            text += content
        out.append((f"wf{k}", text, {"content": content, "reasoning_content": reasoning, "tool_calls": calls}))
    return out


def _c(name, idx, arg):
    return {"id": f"functions.{name}:{idx}", "name": name, "arguments": arg}


_HAND = [
    ("no_think_end", "<think>thinking forever", {"content": "", "reasoning_content": "thinking forever",
                                                 "tool_calls": []}),
    ("think_end_missing_before_calls",
     f"<think>I should call it{SB}{CB}functions.get_weather:0{AB}{{\"city\": \"Oslo\"}}{CE}{SE}",
     {"content": "", "reasoning_content": "I should call it",
      "tool_calls": [_c("get_weather", 0, '{"city": "Oslo"}')]}),
    ("no_call_end", f"{SB}{CB}functions.search:0{AB}{{\"q\": \"x\"}}",
     {"content": "", "reasoning_content": "", "tool_calls": [_c("search", 0, '{"q": "x"}')]}),
    ("no_call_end_then_next", f"{SB}{CB}functions.a:0{AB}{{}}{CB}functions.b:1{AB}{{\"k\": 1}}{CE}{SE}",
     {"content": "", "reasoning_content": "", "tool_calls": [_c("a", 0, "{}"), _c("b", 1, '{"k": 1}')]}),
    ("no_section_end", f"ok{SB}{CB}functions.a:0{AB}{{\"x\": \"y\"}}{CE}",
     {"content": "ok", "reasoning_content": "", "tool_calls": [_c("a", 0, '{"x": "y"}')]}),
    ("truncated_in_header", f"{SB}{CB}functions.a:0{AB}{{}}{CE}{CB}functions.get_wea",
     {"content": "", "reasoning_content": "", "tool_calls": [_c("a", 0, "{}")]}),
    ("truncated_in_args", f"{SB}{CB}functions.a:0{AB}{{\"city\": \"Par",
     {"content": "", "reasoning_content": "", "tool_calls": [_c("a", 0, '{"city": "Par')]}),
    ("truncated_marker_is_text", "Hello <|tool_calls_sec",
     {"content": "Hello <|tool_calls_sec", "reasoning_content": "", "tool_calls": []}),
    ("think_not_at_start", "Answer: <think>x</think>",
     {"content": "Answer: <think>x</think>", "reasoning_content": "", "tool_calls": []}),
    ("singular_section_markers", f"<|tool_call_section_begin|>{CB}functions.f:0{AB}{{}}{CE}<|tool_call_section_end|>",
     {"content": "", "reasoning_content": "", "tool_calls": [_c("f", 0, "{}")]}),
    ("content_after_section", f"{SB}{CB}functions.f:0{AB}{{}}{CE}{SE} done",
     {"content": " done", "reasoning_content": "", "tool_calls": [_c("f", 0, "{}")]}),
    ("header_without_prefix", f"{SB}{CB}lookup:3{AB}{{}}{CE}{SE}",
     {"content": "", "reasoning_content": "", "tool_calls": [{"id": "lookup:3", "name": "lookup",
                                                              "arguments": "{}"}]}),
    ("header_without_index", f"{SB}{CB}functions.lookup{AB}{{}}{CE}{SE}",
     {"content": "", "reasoning_content": "", "tool_calls": [{"id": "functions.lookup", "name": "lookup",
                                                              "arguments": "{}"}]}),
    ("escaped_quotes_and_marker_like_args",
     f"{SB}{CB}functions.echo:0{AB}{{\"s\": \"<|tool_call_end\\\" \\\"q\\\"\"}}{CE}{SE}",
     {"content": "", "reasoning_content": "", "tool_calls": [_c("echo", 0, '{"s": "<|tool_call_end\\" \\"q\\""}')]}),
    ("only_whitespace", "  \n", {"content": "  \n", "reasoning_content": "", "tool_calls": []}),
    ("empty_think", "<think></think>Hi", {"content": "Hi", "reasoning_content": "", "tool_calls": []}),
]


def corpus() -> list:
    return _well_formed(48) + _HAND
