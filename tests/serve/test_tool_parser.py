"""The K2 tool-call and reasoning parser over the recorded-format corpus: whole and streamed at every split."""
from __future__ import annotations

import random

import pytest

from k3c.serve.tool_parser import K2OutputParser, collect, parse_whole

from .k2_corpus import corpus

CASES = corpus()


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 60
    assert sum(1 for _, t, e in CASES if len(e["tool_calls"]) > 1) >= 10


@pytest.mark.parametrize("name,text,expected", CASES, ids=[c[0] for c in CASES])
def test_whole(name, text, expected):
    assert parse_whole(text) == expected


def _streamed(text: str, cuts: list[int]) -> dict:
    p = K2OutputParser()
    events, at = [], 0
    for c in sorted(cuts) + [len(text)]:
        events += p.feed(text[at:c])
        at = c
    return collect(events + p.finish())


@pytest.mark.parametrize("name,text,expected", CASES, ids=[c[0] for c in CASES])
def test_streamed_at_every_split_and_by_character(name, text, expected):
    for cut in range(len(text) + 1):                     # two chunks: every marker split somewhere
        assert _streamed(text, [cut]) == expected, cut
    assert _streamed(text, list(range(len(text)))) == expected          # one character at a time
    rng = random.Random(len(text))
    for _ in range(5):
        assert _streamed(text, rng.sample(range(len(text) + 1), min(len(text), 6))) == expected


def test_no_marker_text_leaks_into_streamed_content():
    text = CASES[1][1]
    p = K2OutputParser()
    shown = "".join(ev.text for ch in text for ev in p.feed(ch) if hasattr(ev, "text"))
    assert "<|" not in shown


def test_without_tools_the_markers_are_content():
    text = "<|tool_calls_section_begin|>x"
    assert parse_whole(text, tools=False)["content"] == text
    assert parse_whole("<think>a</think>b", reasoning=False)["content"] == "<think>a</think>b"
