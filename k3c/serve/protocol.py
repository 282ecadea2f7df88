"""OpenAI request bodies -> GenerationRequest, checked field by field.

    ctx = ModelInfo(name="k3-stdlib", tokenizer=tok, max_context=2048, vocab_size=4096, render_chat=render,
                    max_prompt_chars=tok.max_chars(2048))
    body = decode_body(raw_bytes)           # JSON, at most MAX_JSON_DEPTH deep, no lone surrogate in any string
    req = parse_completion(body, ctx)       # or parse_chat(body, ctx); APIError when a field is wrong

Every problem is an APIError whose body is OpenAI's error object ({"error": {"message", "type", "param", "code"}})
naming the field: wrong types, values out of range, prompts past the context, unknown model names (404),
parameters the server does not implement (400 saying so) and arguments the API does not have (400, as OpenAI
answers "Unrecognized request argument"). Defaults are the API's: temperature 1, top_p 1, n 1, max_tokens 16 for
completions and the rest of the context for chat. Names a client sent are echoed at most SHOWN_CHARS characters
long. A prompt (or a rendered chat) longer than `max_prompt_chars` cannot fit the context and is refused before it
is encoded; all of this is CPU work the server runs in a worker thread, never on its event loop (app.py).
"""
from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass
from typing import Callable

from ..limits import MAX_SEED, MAX_TOP_K
from ..runtime.sampling import SamplingParams
from .api_error import APIError, field_error, json_kind
from .tools import parse_tool_fields

MAX_N = 16                    # choices per request
MAX_STOP = 4                  # stop strings per request (the API's limit)
MAX_STOP_CHARS = 256
MAX_COMPLETION_LOGPROBS = 5   # the completions API's `logprobs` bound
MAX_CHAT_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 32           # nesting of a request body (OpenAI's bodies need 4)
SHOWN_CHARS = 64              # of a client's name (an unknown key) echoed in an error
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class ModelInfo:
    name: str                                   # the model id clients send and /v1/models lists
    tokenizer: object                           # runtime.text.Tokenizer
    max_context: int                            # prompt + completion tokens per sequence
    vocab_size: int
    render_chat: Callable[..., str]             # chat.ChatTemplate.render(messages, tools)
    created: int = 0                            # /v1/models' "created" (server start, Unix seconds)
    max_prompt_chars: int | None = None         # longer prompt text cannot fit max_context (Tokenizer.max_chars;
                                                # None: no such bound)
    grammars: object = None                     # grammar.Grammars of the tokenizer (None: no constrained decoding)


@dataclass(frozen=True)
class GenerationRequest:
    kind: str                                   # "completion" | "chat"
    prompts: tuple[tuple[int, ...], ...]        # token ids of each prompt (chat: one)
    max_tokens: int
    sampling: SamplingParams                    # the first choice's; choice i draws from seed + i
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None                 # top alternatives per token (0: the chosen token's only); None: off
    stream: bool = False
    include_usage: bool = False                 # stream_options.include_usage: a last chunk with the usage
    model: str = ""                             # the model id the request named (echoed in the response)
    logits: dict | None = None                  # runtime.logits_processors.RowLogits arguments (penalties, biases)
    tools: object = None                        # tools.ToolFields of a chat request
    continuous_usage: bool = False              # stream_options.continuous_usage_stats: usage on every chunk

    @property
    def grammar(self):
        return getattr(self.tools, "grammar", None)


def shown(name: str) -> str:
    """A client's name as an error echoes it: at most SHOWN_CHARS characters."""
    return name if len(name) <= SHOWN_CHARS else name[:SHOWN_CHARS] + "..."


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{shown(p)}" if out else shown(p))
    return out


def decode_body(raw: bytes):
    """A request body's JSON value: 400 when it is not UTF-8 JSON, nests deeper than MAX_JSON_DEPTH, or holds a
    string (a key included) with a lone UTF-16 surrogate (JSON's "\\ud800" escape: no text, and not encodable to
    UTF-8), naming where."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") \
            from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({str(exc)[:160]})", code="invalid_json") from None
    stack = [(body, 1, ())] if isinstance(body, (dict, list)) else []
    while stack:                                 # containers only: scalars are checked where they sit
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at "
                           f"{_path(where) or 'the top'})", code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, v in items:
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise field_error(_path(where) or None, f"a key holds a lone UTF-16 surrogate ({ascii(shown(key))})",
                           code="invalid_unicode")
            if isinstance(v, str):
                if not v.isascii() and _SURROGATE.search(v):
                    raise field_error(_path(where + (key,)), "holds a lone UTF-16 surrogate (not text)",
                               code="invalid_unicode")
            elif isinstance(v, (dict, list)):
                stack.append((v, depth + 1, where + (key,)))
    if isinstance(body, str) and _SURROGATE.search(body):
        raise field_error("", "the request body holds a lone UTF-16 surrogate", code="invalid_unicode")
    return body


def _integer(body: dict, name: str, default, low: int, high: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise field_error(name, f"expected an integer, got {json_kind(v)}")
    if v < low or (high is not None and v > high):
        raise field_error(name, f"{v} is out of range: it must be in [{low}, {high}]" if high is not None
                   else f"{v} is out of range: it must be >= {low}")
    return int(v)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise field_error(name, f"expected a finite number, got {json_kind(v) if not isinstance(v, float) else v}")
    if v < low or v > high or (low_open and v == low):
        raise field_error(name, f"{v} is out of range: it must be in {'(' if low_open else '['}{low:g}, {high:g}]")
    return float(v)


def _boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise field_error(name, f"expected a boolean, got {json_kind(v)}")
    return v


def _unsupported(body: dict, name: str, allowed: Callable[[object], bool], why: str) -> None:
    if name in body and body[name] is not None and not allowed(body[name]):
        raise field_error(name, f"not supported by this server ({why})", code="unsupported_parameter")


def _check_keys(body: dict, known: frozenset) -> None:
    for key in body:
        if key not in known:
            raise field_error(shown(key), "unrecognized request argument", code="unrecognized_argument")


def _model(body: dict, ctx: ModelInfo) -> str:
    v = body.get("model")
    if not isinstance(v, str):
        raise field_error("model", "required: a string naming the model" if v is None else
                   f"expected a string, got {json_kind(v)}")
    if v != ctx.name:
        raise APIError(404, f"the model {v[:200]!r} does not exist; this server serves {ctx.name!r}",
                       param="model", code="model_not_found")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise field_error("stop", f"expected a string or an array of strings, got {json_kind(v)}")
    if len(items) > MAX_STOP:
        raise field_error("stop", f"at most {MAX_STOP} stop sequences, got {len(items)}")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise field_error("stop", f"each stop sequence must hold 1 to {MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(items))


def _sampling(body: dict) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0, -1, MAX_TOP_K)  # vLLM's spelling of "off" (-1) is accepted as 0's
    seed = _integer(body, "seed", None, 0, MAX_SEED)
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed)


def _stream(body: dict) -> tuple[bool, bool, bool]:
    stream = _boolean(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not stream:
        raise field_error("stream_options", "only allowed with stream: true")
    if not isinstance(opts, dict):
        raise field_error("stream_options", f"expected an object, got {json_kind(opts)}")
    _check_keys({f"stream_options.{k}": v for k, v in opts.items()},
                frozenset({"stream_options.include_usage", "stream_options.continuous_usage_stats"}))
    return stream, _boolean({"stream_options.include_usage": opts.get("include_usage")},
                            "stream_options.include_usage", False), \
        _boolean({"stream_options.continuous_usage_stats": opts.get("continuous_usage_stats")},
                 "stream_options.continuous_usage_stats", False)


def _token_ids(v: list, param: str, ctx: ModelInfo) -> tuple[int, ...]:
    if not v:
        raise field_error(param, "a prompt must hold at least one token")
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int):
            raise field_error(param, f"token ids must be integers, got {json_kind(t)}")
        if not 0 <= t < ctx.vocab_size:
            raise field_error(param, f"token id {t} is outside the vocabulary [0, {ctx.vocab_size})")
    return tuple(v)


def _encode(text: str, param: str, ctx: ModelInfo) -> tuple[int, ...]:
    if ctx.max_prompt_chars is not None and len(text) > ctx.max_prompt_chars:
        raise APIError(400, f"this model's maximum context length is {ctx.max_context} tokens; the prompt holds "
                       f"{len(text)} characters, more than any text of {ctx.max_context} tokens can "
                       f"({ctx.max_prompt_chars})", param=param, code="context_length_exceeded")
    ids = tuple(ctx.tokenizer.encode(text))
    if not ids:
        raise field_error(param, "the prompt encodes to no tokens")
    return ids


def _prompts(body: dict, ctx: ModelInfo) -> tuple[tuple[int, ...], ...]:
    """The completions API's four prompt forms: a string, an array of strings, an array of token ids, an array of
    arrays of token ids."""
    v = body.get("prompt")
    if v is None:
        raise field_error("prompt", "required: a string, an array of strings or an array of token ids")
    if isinstance(v, str):
        return (_encode(v, "prompt", ctx),)
    if not isinstance(v, list) or not v:
        raise field_error("prompt", "expected a string or a non-empty array, got "
                          f"{json_kind(v) if v != [] else 'an empty array'}")
    if all(isinstance(p, str) for p in v):
        return tuple(_encode(p, f"prompt[{i}]", ctx) for i, p in enumerate(v))
    if all(isinstance(p, int) and not isinstance(p, bool) for p in v):
        return (_token_ids(v, "prompt", ctx),)
    if all(isinstance(p, list) for p in v):
        return tuple(_token_ids(p, f"prompt[{i}]", ctx) for i, p in enumerate(v))
    raise field_error("prompt", "an array prompt must hold only strings, only token ids or only arrays of token ids")


def _fits(prompts, max_tokens: int | None, ctx: ModelInfo, param: str, prompt_param: str) -> int:
    """max_tokens, checked against the context (None: the rest of the context of the longest prompt)."""
    longest = max(len(p) for p in prompts)
    room = ctx.max_context - longest
    if room < 1:
        raise APIError(400, f"this model's maximum context length is {ctx.max_context} tokens; the prompt holds "
                       f"{longest} tokens, leaving no room for a completion", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is None:
        return room
    if longest + max_tokens > ctx.max_context:
        raise APIError(400, f"this model's maximum context length is {ctx.max_context} tokens; you requested "
                       f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the completion): "
                       f"lower {param} to at most {room}", param=param, code="context_length_exceeded")
    return max_tokens


_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
                     "stop", "seed", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user",
                     "repetition_penalty",
                     "best_of", "metadata", "store", "service_tier"})
_COMPLETION_KEYS = _COMMON | {"prompt", "echo", "suffix"}
_CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                        "function_call", "response_format", "parallel_tool_calls", "modalities", "audio",
                        "prediction", "reasoning_effort", "web_search_options"}


def _refuse_unsupported(body: dict) -> None:
    _unsupported(body, "echo", lambda v: v is False, "the prompt is not echoed")
    _unsupported(body, "suffix", lambda v: v == "", "no insertion")
    _unsupported(body, "modalities", lambda v: v == ["text"], "text only")
    for name in ("audio", "prediction", "web_search_options", "reasoning_effort"):
        _unsupported(body, name, lambda v: False, "not implemented")


def _common(body: dict, ctx: ModelInfo) -> dict:
    if not isinstance(body, dict):
        raise field_error("", f"the request body must be a JSON object, got {json_kind(body)}")
    _model(body, ctx)
    _refuse_unsupported(body)
    n = _integer(body, "n", 1, 1, MAX_N)
    best_of = _integer(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise field_error("best_of", "not supported by this server (best_of must equal n)",
                          code="unsupported_parameter")
    stream, include_usage, continuous = _stream(body)
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise field_error("user", f"expected a string, got {json_kind(body['user'])}")
    return dict(sampling=_sampling(body), n=n, stop=_stop(body), stream=stream, include_usage=include_usage,
                continuous_usage=continuous, model=body["model"], logits=_logits(body, ctx))


def _logits(body: dict, ctx: ModelInfo) -> dict | None:
    """RowLogits' arguments: presence / frequency penalties in [-2, 2] (OpenAI), repetition_penalty in (0, 2]
    (vLLM's extension, transformers' rule), logit_bias {token id: bias in [-100, 100]}; None when all are off."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name, 0.0, -2.0, 2.0)
        if v:
            out[name] = v
    r = _number(body, "repetition_penalty", 1.0, 0.0, 2.0, low_open=True)
    if r != 1.0:
        out["repetition_penalty"] = r
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise field_error("logit_bias", f"expected an object of token ids to numbers, got {json_kind(bias)}")
        if len(bias) > ctx.vocab_size:
            raise field_error("logit_bias", f"at most {ctx.vocab_size} entries (the vocabulary)")
        parsed = {}
        for k, v in bias.items():
            where = f"logit_bias.{shown(k)}"
            if not k.isascii() or not k.isdigit() or int(k) >= ctx.vocab_size:
                raise field_error(where, f"keys must be token ids in [0, {ctx.vocab_size})")
            parsed[int(k)] = _number({where: v}, where, 0.0, -100.0, 100.0)
        if any(parsed.values()):
            out["logit_bias"] = {t: b for t, b in parsed.items() if b}
    return out or None


def parse_completion(body, ctx: ModelInfo) -> GenerationRequest:
    """A /v1/completions body."""
    common = _common(body, ctx)
    _check_keys(body, _COMPLETION_KEYS)
    prompts = _prompts(body, ctx)
    if len(prompts) * common["n"] > MAX_N * 4:
        raise field_error("prompt", f"at most {MAX_N * 4} choices (prompts x n) per request")
    max_tokens = _fits(prompts, _integer(body, "max_tokens", 16, 1), ctx, "max_tokens", "prompt")
    logprobs = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    return GenerationRequest("completion", prompts, max_tokens, logprobs=logprobs, **common)


def _messages(body: dict) -> list[dict]:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise field_error("messages", "required: a non-empty array of messages" if v is None or v == [] else
                   f"expected an array, got {json_kind(v)}")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise field_error(where, f"expected an object, got {json_kind(m)}")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise field_error(f"{where}.role",
                              f"must be system, developer, user, assistant or tool, got {role!r}"[:200])
        content = m.get("content")
        if isinstance(content, list):            # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise field_error(f"{where}.content[{j}]", 'only {"type": "text", "text": ...} parts are supported')
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise field_error(f"{where}.content",
                              f"expected a string or an array of text parts, got {json_kind(content)}")
        extra = {}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise field_error(f"{where}.tool_calls", "only assistant messages make tool calls")
            extra["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str):
                raise field_error(f"{where}.tool_call_id", "required for a tool message: the id of the call it answers")
            extra["tool_call_id"] = tid
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise field_error(f"{where}.name", f"expected a string, got {json_kind(name)}")
        out.append({"role": role, "content": content, **({"name": name} if name else {}), **extra})
    return out


def _tool_calls(v, where: str) -> list[dict]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name", "arguments": str}}]."""
    if not isinstance(v, list):
        raise field_error(where, f"expected an array, got {json_kind(v)}")
    out = []
    for i, c in enumerate(v):
        at = f"{where}[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise field_error(at, 'expected {"id", "type": "function", "function": {"name", "arguments"}}')
        f = c["function"]
        if not isinstance(f.get("name"), str) or not isinstance(f.get("arguments", ""), str):
            raise field_error(f"{at}.function", "name and arguments must be strings")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise field_error(f"{at}.id", f"expected a string, got {json_kind(cid)}")
        out.append({"id": cid or f"functions.{f['name']}:{i}", "type": "function",
                    "function": {"name": f["name"], "arguments": f.get("arguments", "")}})
    return out


def parse_chat(body, ctx: ModelInfo) -> GenerationRequest:
    """A /v1/chat/completions body: its messages rendered by the chat template (with the tools offered), then
    encoded; the tool and output-format fields checked and their grammar compiled (tools.py)."""
    common = _common(body, ctx)
    _check_keys(body, _CHAT_KEYS)
    messages = _messages(body)
    tools = parse_tool_fields(body, ctx.grammars)
    text = ctx.render_chat(messages, tools.template_tools())
    ids = _encode(text, "messages", ctx)
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _fits((ids,), _integer(body, param, None, 1), ctx, param, "messages")
    want = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not want:
        raise field_error("top_logprobs", "needs logprobs: true")
    return GenerationRequest("chat", (ids,), max_tokens, logprobs=(top or 0) if want else None, tools=tools,
                             **common)


def parse_tokenize(body, ctx: ModelInfo) -> tuple[int, ...]:
    """A /tokenize body (vLLM's): {"model"?, "prompt": str} or {"model"?, "messages", "tools"?} -> the token ids
    (a chat rendered by the template as /v1/chat/completions renders it)."""
    if not isinstance(body, dict):
        raise field_error("", f"the request body must be a JSON object, got {json_kind(body)}")
    if body.get("model") is not None:
        _model(body, ctx)
    _check_keys(body, frozenset({"model", "prompt", "messages", "tools", "add_special_tokens",
                                 "add_generation_prompt"}))
    if ("prompt" in body) == ("messages" in body):
        raise field_error("prompt", "send either prompt (a string) or messages")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise field_error("prompt", f"expected a string, got {json_kind(body['prompt'])}")
        return _encode(body["prompt"], "prompt", ctx)
    tools = parse_tool_fields({"tools": body.get("tools")}, None)
    return _encode(ctx.render_chat(_messages(body), tools.template_tools()), "messages", ctx)


def parse_detokenize(body, ctx: ModelInfo) -> str:
    """A /detokenize body (vLLM's): {"model"?, "tokens": [ids]} -> their text."""
    if not isinstance(body, dict):
        raise field_error("", f"the request body must be a JSON object, got {json_kind(body)}")
    if body.get("model") is not None:
        _model(body, ctx)
    _check_keys(body, frozenset({"model", "tokens"}))
    v = body.get("tokens")
    if not isinstance(v, list):
        raise field_error("tokens", "required: an array of token ids" if v is None else
                          f"expected an array, got {json_kind(v)}")
    if len(v) > ctx.max_context:
        raise field_error("tokens", f"at most {ctx.max_context} tokens (the context)")
    return ctx.tokenizer.decode(_token_ids(v, "tokens", ctx)) if v else ""
