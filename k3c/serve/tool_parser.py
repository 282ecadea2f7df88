"""Generated text -> content, reasoning and tool calls, in Kimi K2's format, incrementally.

    p = K2OutputParser(reasoning=True)
    for piece in text_deltas:
        for ev in p.feed(piece):    # Content | Reasoning | CallStart(index, id, name) | CallArgs(index, text)
            ...
    events = p.finish()             # what was held back, once no text will follow

The format (Kimi K2's chat template and its vLLM / SGLang parsers):

    <think>reasoning</think>content<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{"json": "arguments"}<|tool_call_end|>
    ...more calls...
    <|tool_calls_section_end|>

Text that could be the start of a marker is held back until it is decided, so a marker split across stream chunks
(or tokens) is never shown as text; the events of a stream, joined, equal the events of the whole text fed at once
(tests/serve/test_tool_parser.py checks this for every split of a recorded corpus).

Malformed and truncated outputs, as models produce them:
- `<think>` only counts at the start of the output (leading whitespace allowed); a missing `</think>` leaves the rest
  reasoning, unless a tool-call section begins: that ends the reasoning (a model that forgot to close it);
- a missing `<|tool_call_end|>` ends the call at the next `<|tool_call_begin|>`, the section end or the output's end;
  a missing `<|tool_calls_section_end|>` is tolerated; text after the section end is content;
- a call whose header (`functions.NAME:IDX`) never reached `<|tool_call_argument_begin|>` is dropped (the output was
  cut there: nothing callable); a header without the `functions.` prefix or the `:IDX` suffix names the function
  by what is there (the id is the header as written);
- arguments are passed on as the model wrote them (a JSON object's text); they are not re-serialized.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_BEGIN, THINK_END = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# K2's chat template writes the singular spellings as well; models trained on it emit both
ALIASES = {"<|tool_call_section_begin|>": SECTION_BEGIN, "<|tool_call_section_end|>": SECTION_END}


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int          # the call's position in this message (OpenAI's tool_calls[].index)
    id: str             # the header as the model wrote it: functions.NAME:IDX (K2's call id)
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


def split_header(header: str) -> tuple[str, str]:
    """(call id, function name) of a call header `functions.NAME:IDX`."""
    hid = header.strip()
    name = hid[len("functions."):] if hid.startswith("functions.") else hid
    head, sep, idx = name.rpartition(":")
    if sep and idx.isdigit():
        name = head
    return hid, name


class K2OutputParser:
    """An incremental parser of one choice's text (module docstring)."""

    def __init__(self, *, reasoning: bool = True, tools: bool = True):
        self._reasoning = reasoning
        self._tools = tools
        self._buf = ""
        # start: before anything (a <think> may open); think; content; section (between calls); header; args; done
        self._state = "start" if reasoning else "content"
        self._header = ""
        self.calls = 0                  # calls started so far
        self.seen_section = False

    # -- markers the current state looks for, in order of preference -------------------------------------------
    def _markers(self) -> tuple[str, ...]:
        s = self._state
        section = (SECTION_BEGIN, *[a for a, b in ALIASES.items() if b == SECTION_BEGIN]) if self._tools else ()
        if s == "start":
            return (THINK_BEGIN,)
        if s == "think":
            return (THINK_END, *section)
        if s == "content":
            return section
        if s == "section":
            return (CALL_BEGIN, SECTION_END, *[a for a, b in ALIASES.items() if b == SECTION_END])
        if s == "header":
            return (ARG_BEGIN, CALL_BEGIN, SECTION_END)
        if s == "args":
            return (CALL_END, CALL_BEGIN, SECTION_END)
        return ()

    def _emit_text(self, text: str, out: list) -> None:
        if not text:
            return
        s = self._state
        if s == "think":
            out.append(Reasoning(text))
        elif s in ("content", "done"):
            out.append(Content(text))
        elif s == "header":
            self._header += text
        elif s == "args":
            out.append(CallArgs(self.calls - 1, text))
        # between calls ("section"): whitespace and stray text are not part of any call

    def _on_marker(self, marker: str, out: list) -> None:
        marker = ALIASES.get(marker, marker)
        s = self._state
        if marker == THINK_BEGIN:
            self._state = "think"
        elif marker == THINK_END:
            self._state = "content"
        elif marker == SECTION_BEGIN:
            self.seen_section = True
            self._state = "section"
        elif marker == CALL_BEGIN:
            if s == "header":                   # a header that never got its arguments: dropped
                self._header = ""
            self._state = "header"
        elif marker == ARG_BEGIN:
            hid, name = split_header(self._header)
            self._header = ""
            out.append(CallStart(self.calls, hid, name))
            self.calls += 1
            self._state = "args"
        elif marker == CALL_END:
            self._state = "section"
        elif marker == SECTION_END:
            self._header = ""
            self._state = "done"

    def feed(self, text: str) -> list:
        """Events decided by `text` appended to what came before."""
        self._buf += text
        out: list = []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if not stripped:
                    return out                  # only whitespace so far: a <think> may still follow
                if stripped.startswith(THINK_BEGIN):
                    self._buf = stripped[len(THINK_BEGIN):]
                    self._state = "think"
                    continue
                if THINK_BEGIN.startswith(stripped):
                    return out                  # a <think> split across chunks
                self._state = "content"         # no reasoning: everything so far is content
                continue
            markers = self._markers()
            hits = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
            if hits:
                at, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
                self._emit_text(self._buf[:at], out)
                self._buf = self._buf[at + len(marker):]
                self._on_marker(marker, out)
                continue
            hold = 0                            # the longest tail that may begin a marker
            for m in markers:
                for k in range(min(len(m) - 1, len(self._buf)), 0, -1):
                    if self._buf.endswith(m[:k]):
                        hold = max(hold, k)
                        break
            cut = len(self._buf) - hold
            self._emit_text(self._buf[:cut], out)
            self._buf = self._buf[cut:]
            return out

    def finish(self) -> list:
        """The rest, once no text will follow: held-back text goes where it stands (a truncated marker is text); an
        unfinished call header is dropped."""
        out: list = []
        if self._state == "start":
            self._state = "content"
        self._emit_text(self._buf, out)
        self._buf = ""
        if self._state == "header":
            self._header = ""
        return out


def parse_whole(text: str, *, reasoning: bool = True, tools: bool = True) -> dict:
    """The whole text's {"content", "reasoning_content", "tool_calls": [{"id", "name", "arguments"}]}."""
    p = K2OutputParser(reasoning=reasoning, tools=tools)
    return collect(p.feed(text) + p.finish())


def collect(events) -> dict:
    """Events joined: {"content": str, "reasoning_content": str, "tool_calls": [{"id", "name", "arguments"}]}."""
    content, reasoning, calls = [], [], []
    for ev in events:
        if isinstance(ev, Content):
            content.append(ev.text)
        elif isinstance(ev, Reasoning):
            reasoning.append(ev.text)
        elif isinstance(ev, CallStart):
            calls.append({"id": ev.id, "name": ev.name, "arguments": ""})
        elif isinstance(ev, CallArgs):
            calls[ev.index]["arguments"] += ev.text
    return {"content": "".join(content), "reasoning_content": "".join(reasoning), "tool_calls": calls}
