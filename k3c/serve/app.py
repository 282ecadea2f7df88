"""The HTTP side: a Starlette app over an EngineLoop.

    app = build_app(loop, info, metrics, api_key=None)     # uvicorn.Server(uvicorn.Config(app, ...)).serve()

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events with "stream": true,
ending in `data: [DONE]`), GET /v1/models, /health and /metrics. With an API key every /v1 route wants
`Authorization: Bearer <key>` (401 otherwise); /health and /metrics stay open to the monitoring that probes them.
A handler parses and checks the body (protocol.py), turns each choice into a Job for the engine loop and only waits
on its events: a client that disconnects has its jobs cancelled (their pages free at the next step), a stop string
cancels its choice the same way. Every error is OpenAI's JSON error object with a 4xx / 5xx status; inside a
stream it is a last `data: {"error": ...}` event before `[DONE]`.

Nothing slow runs on the event loop, so one client cannot stall the others (or /health): the body is read as it
arrives, at most `max_body_bytes` (413 past it, before reading on when Content-Length says so) and within
`body_timeout` seconds (408, then the connection closes); decoding the JSON, the checks, rendering the chat template
and encoding the prompt run in a worker thread (at most PARSE_THREADS at once). A client that leaves during its
upload costs one log line. A 5xx body says what failed and a reference to the log line holding the traceback,
never the exception's text.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid

import anyio
import anyio.to_thread
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..runtime.logits_processors import RowLogits
from ..runtime.sampling import params_for_rows
from .engine_loop import EngineLoop, ErrorEvent, Job, TokenEvent, server_error
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (APIError, GenerationRequest, ModelInfo, decode_body, parse_chat, parse_completion,
                       parse_detokenize, parse_tokenize, shown)
from .text_stream import TextStream
from .tool_parser import CallArgs, CallStart, Content, K2OutputParser, Reasoning, collect

log = logging.getLogger("k3c.serve")

MAX_BODY_BYTES = 8 << 20          # no request body is larger, whatever the context (body_limit)
SHUTDOWN_GRACE_S = 5.0            # streams get this long to send their last (error) event on shutdown
BODY_TIMEOUT_S = 60.0             # a request body must arrive within this (--body-timeout)
PARSE_THREADS = 4                 # request bodies decoded, checked and encoded at once (worker threads)


def body_limit(max_prompt_chars: int | None) -> int:
    """The largest request body: room for 8 prompts of the longest text that can fit the context, each character
    escaped (\\uXXXX: 6 bytes), and 1 MiB for the rest; at most MAX_BODY_BYTES."""
    if max_prompt_chars is None:
        return MAX_BODY_BYTES
    return min(MAX_BODY_BYTES, (1 << 20) + 8 * 6 * max_prompt_chars)


class _Choice:
    """What one choice has produced so far, as the client will see it. A chat choice's text goes through the K2
    output parser (reasoning, and tool calls when tools were offered): `message` holds what it made of it."""

    def __init__(self, job: Job, tokenizer, stop, eos_id, parser: K2OutputParser | None = None):
        self.job, self._tok, self._eos = job, tokenizer, eos_id
        self.text = TextStream(tokenizer, stop, keep_special=parser is not None)
        self.parser = parser
        self.finish_reason: str | None = None
        self.tokens = 0
        self.logprobs: list[tuple[int, float, list]] = []     # (token, logprob, top) per token, in order
        self.events: list = []                                # the parser's events so far

    def chat_delta(self, text: str) -> dict:
        """The chat delta of new text (OpenAI's shape: content, reasoning_content, tool_calls); at the end (a
        finish_reason set) what the parser held back too, and "tool_calls" as the reason when calls were made."""
        if self.parser is None:
            return {"content": text} if text else {}
        events = self.parser.feed(text) if text else []
        if self.finish_reason is not None:
            events += self.parser.finish()
            if self.finish_reason == "stop" and self.parser.calls:
                self.finish_reason = "tool_calls"
        self.events += events
        return delta_of(events)

    def message(self) -> dict:
        """The whole message: the same parser events joined."""
        if self.parser is None:
            return {"role": "assistant", "content": self.text.text}
        parsed = collect(self.events)
        msg = {"role": "assistant", "content": parsed["content"] if parsed["content"] or not parsed["tool_calls"]
               else None}
        if parsed["reasoning_content"]:
            msg["reasoning_content"] = parsed["reasoning_content"]
        if parsed["tool_calls"]:
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in parsed["tool_calls"]]
        return msg

    def on_token(self, ev: TokenEvent, loop: EngineLoop) -> tuple[str, list]:
        """(new text, new log-prob entries) of one token; sets finish_reason once the choice has ended."""
        if self.finish_reason is not None:
            return "", []
        self.tokens += 1
        entries = [(ev.token, ev.logprob, ev.top or [])] if ev.logprob is not None else []
        if ev.token == self._eos:
            self.finish_reason = "stop"           # the EOS token is counted, neither shown nor scored
            return self.text.finish(), []
        delta = self.text.push(ev.token)
        if self.text.stopped:
            self.finish_reason = "stop"
            if not ev.finished:
                loop.cancel(self.job, "stop")
        elif ev.finished:
            self.finish_reason = ev.reason or "length"      # stop: the request's grammar is complete
            delta += self.text.finish()
        self.logprobs += entries
        return delta, entries

    def token_text(self, token: int) -> str:
        return self._tok.decode([token])


def _row_logits(req: GenerationRequest) -> RowLogits | None:
    """One choice's logit changes: its own grammar matcher (a choice's grammar state is its own)."""
    grammar = req.grammar.matcher() if req.grammar is not None else None
    if req.logits is None and grammar is None:
        return None
    return RowLogits(**(req.logits or {}), grammar=grammar)


def _parser(req: GenerationRequest) -> K2OutputParser | None:
    """A chat choice's output parser: reasoning always (K3 thinks), tool calls when tools were offered."""
    if req.kind != "chat":
        return None
    return K2OutputParser(reasoning=True, tools=bool(req.tools is not None and req.tools.parse_calls))


def delta_of(events) -> dict:
    """Parser events as one chat delta: content and reasoning_content joined, tool_calls in OpenAI's streaming
    shape (a call's first entry carries its id, type and name; later ones add to its arguments)."""
    delta: dict = {}
    calls: dict[int, dict] = {}
    for ev in events:
        if isinstance(ev, Content):
            delta["content"] = delta.get("content", "") + ev.text
        elif isinstance(ev, Reasoning):
            delta["reasoning_content"] = delta.get("reasoning_content", "") + ev.text
        elif isinstance(ev, CallStart):
            calls[ev.index] = {"index": ev.index, "id": ev.id, "type": "function",
                               "function": {"name": ev.name, "arguments": ""}}
        elif isinstance(ev, CallArgs):
            calls.setdefault(ev.index, {"index": ev.index, "function": {"arguments": ""}})
            calls[ev.index]["function"]["arguments"] += ev.text
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


class Server:
    def __init__(self, loop: EngineLoop, info: ModelInfo, metrics: ServerMetrics, api_key: str | None = None, *,
                 body_timeout: float = BODY_TIMEOUT_S, max_body_bytes: int | None = None):
        self.loop, self.info, self.metrics, self.api_key = loop, info, metrics, api_key
        self.eos_id = loop.eos_id
        self.body_timeout = body_timeout
        self.max_body_bytes = max_body_bytes if max_body_bytes is not None else body_limit(info.max_prompt_chars)
        self._parsers = anyio.CapacityLimiter(PARSE_THREADS)

    # -- plumbing -----------------------------------------------------------------------------------------------
    def _count(self, endpoint: str, status: int) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()

    def _error(self, endpoint: str, err: APIError) -> JSONResponse:
        self._count(endpoint, err.status)
        # a body not read to its end leaves the connection unusable for the next request
        headers = {"Connection": "close"} if err.status in (408, 413) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           type="authentication_error", code="invalid_api_key")

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over {self.max_body_bytes} bytes, this server's limit",
                        code="body_too_large")

    async def _body(self, request: Request) -> bytes:
        """The raw body: 413 past max_body_bytes, 408 when it has not all come within body_timeout;
        ClientDisconnect when the client leaves first."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise self._too_large()
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise self._too_large()
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} s ({size} bytes "
                           f"came)", code="request_timeout") from None
        return b"".join(chunks)

    async def _parse(self, raw: bytes, parse) -> GenerationRequest:
        """decode_body + parse in a worker thread (JSON, checks, chat template, tokenizer: CPU work)."""
        return await anyio.to_thread.run_sync(lambda: parse(decode_body(raw), self.info), limiter=self._parsers)

    # -- routes -------------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except APIError as err:
            return self._error("models", err)
        self._count("models", 200)
        return JSONResponse({"object": "list", "data": [
            {"id": self.info.name, "object": "model", "created": self.info.created, "owned_by": "k3c",
             "max_model_len": self.info.max_context}]})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {"prompt": str} or {"messages": [...], "tools"?} (rendered by the chat template) ->
        {"tokens", "count", "max_model_len"}."""
        def work(raw):
            ids = parse_tokenize(decode_body(raw), self.info)
            return {"tokens": list(ids), "count": len(ids), "max_model_len": self.info.max_context}
        return await self._simple(request, "tokenize", work)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        def work(raw):
            return {"prompt": parse_detokenize(decode_body(raw), self.info)}
        return await self._simple(request, "detokenize", work)

    async def _simple(self, request: Request, endpoint: str, work) -> Response:
        try:
            self._authorize(request)
            raw = await self._body(request)
            out = await anyio.to_thread.run_sync(lambda: work(raw), limiter=self._parsers)  # CPU work
        except ClientDisconnect:
            self._count(endpoint, 499)
            return Response(status_code=499)
        except APIError as err:
            return self._error(endpoint, err)
        self._count(endpoint, 200)
        return JSONResponse(out)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat", parse_chat)

    async def _generate(self, request: Request, endpoint: str, parse) -> Response:
        t_arrival = time.perf_counter()
        try:
            self._authorize(request)
            try:
                raw = await self._body(request)
            except ClientDisconnect:
                client = request.client
                log.warning("k3c serve: %s:%s left during the upload of %s %s (Content-Length %s)",
                            client.host if client else "?", client.port if client else "?", request.method,
                            shown(request.url.path), shown(request.headers.get("content-length", "none")))
                self._count(endpoint, 499)
                return Response(status_code=499)
            req = await self._parse(raw, parse)
            events: asyncio.Queue = asyncio.Queue()
            aloop = asyncio.get_running_loop()
            rows = params_for_rows(req.sampling, len(req.prompts) * req.n)
            procs = await anyio.to_thread.run_sync(lambda: [_row_logits(req) for _ in rows], limiter=self._parsers)
            jobs = [Job(index=i, prompt=req.prompts[i // req.n], max_tokens=req.max_tokens, sampling=rows[i],
                        logprobs=req.logprobs, events=events, aloop=aloop, t_arrival=t_arrival, logits=procs[i])
                    for i in range(len(rows))]
            for job in jobs:
                self.loop.submit(job)
        except APIError as err:
            return self._error(endpoint, err)
        choices = [_Choice(j, self.info.tokenizer, req.stop, self.eos_id, _parser(req)) for j in jobs]
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            self._count(endpoint, 200)
            return EventSourceResponse(self._stream(req, jobs, choices, events, rid, created), ping=15,
                                       shutdown_event=anyio.Event(), shutdown_grace_period=SHUTDOWN_GRACE_S)
        return await self._whole(request, endpoint, req, jobs, choices, events, rid, created)

    def _cancel_open(self, jobs) -> None:
        for job in jobs:
            if not job.closed:
                self.loop.cancel(job)

    async def _whole(self, request, endpoint, req, jobs, choices, events, rid, created) -> Response:
        """A non-streamed response, once every choice has ended; the client leaving first cancels them."""
        async def collect():
            while any(c.finish_reason is None for c in choices):
                ev = await events.get()
                if isinstance(ev, ErrorEvent):
                    return ev.error
                c = choices[ev.index]
                delta, _ = c.on_token(ev, self.loop)
                if req.kind == "chat":
                    c.chat_delta(delta)
            return None

        async def disconnected():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                self._cancel_open(jobs)
            gone.cancel()
        if not work.done() or work.cancelled():
            self._count(endpoint, 499)               # nginx's "client closed request": nobody to answer
            return Response(status_code=499)
        error = work.result()
        if error is not None:
            self._cancel_open(jobs)
            return self._error(endpoint, error)
        self._count(endpoint, 200)
        body = {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                "created": created, "model": req.model, "choices": [self._choice_body(req, c) for c in choices],
                "usage": self._usage(req, choices)}
        return JSONResponse(body)

    # -- bodies ------------------------------------------------------------------------------------------------
    def _usage(self, req: GenerationRequest, choices) -> dict:
        prompt = sum(len(p) for p in req.prompts)
        done = sum(c.tokens for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _logprobs_body(self, req: GenerationRequest, c: _Choice, entries, offset: int = 0):
        if req.logprobs is None:
            return None
        if req.kind == "chat":
            def item(tok, lp):
                s = c.token_text(tok)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]}
                                for t, lp, top in entries]}
        texts = [c.token_text(t) for t, _, _ in entries]
        offsets, at = [], offset
        for s in texts:
            offsets.append(at)
            at += len(s)
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{c.token_text(a): b for a, b in top} for _, _, top in entries] if req.logprobs
                else None, "text_offset": offsets}

    def _choice_body(self, req: GenerationRequest, c: _Choice) -> dict:
        lp = self._logprobs_body(req, c, c.logprobs)
        if req.kind == "chat":
            return {"index": c.job.index, "message": c.message(), "logprobs": lp, "finish_reason": c.finish_reason}
        return {"index": c.job.index, "text": c.text.text, "logprobs": lp, "finish_reason": c.finish_reason}

    async def _stream(self, req, jobs, choices, events, rid, created):
        """Server-sent events: one chunk per token that adds text (or ends a choice), the usage chunk when asked
        for, then [DONE]. Closed early (the client left, the server stops): the open choices are cancelled."""
        kind = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        head = {"id": rid, "object": kind, "created": created, "model": req.model}
        sent_role = set()
        offsets = [0] * len(choices)
        try:
            if req.kind == "chat":
                for c in choices:
                    sent_role.add(c.job.index)
                    chunk = {**head, "choices": [{"index": c.job.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
                    if req.continuous_usage:
                        chunk["usage"] = self._usage(req, choices)
                    yield json.dumps(chunk)
            while any(c.finish_reason is None for c in choices):
                ev = await events.get()
                if isinstance(ev, ErrorEvent):
                    yield json.dumps(ev.error.body())
                    break
                c = choices[ev.index]
                delta, entries = c.on_token(ev, self.loop)
                if not delta and not entries and c.finish_reason is None:
                    continue
                lp = self._logprobs_body(req, c, entries, offsets[ev.index])
                offsets[ev.index] += len(delta)
                if req.kind == "chat":
                    part = {"index": ev.index, "delta": c.chat_delta(delta), "logprobs": lp,
                            "finish_reason": c.finish_reason}
                    if not part["delta"] and not entries and c.finish_reason is None:
                        continue                  # text the parser holds back (a marker may be starting)
                else:
                    part = {"index": ev.index, "text": delta, "logprobs": lp, "finish_reason": c.finish_reason}
                chunk = {**head, "choices": [part]}
                if req.continuous_usage:
                    chunk["usage"] = self._usage(req, choices)
                yield json.dumps(chunk)
            else:
                if req.include_usage:
                    yield json.dumps({**head, "choices": [], "usage": self._usage(req, choices)})
            yield "[DONE]"
        finally:
            self._cancel_open(jobs)


async def _not_found(request: Request, exc: HTTPException) -> Response:
    err = APIError(exc.status_code, f"{shown(request.method)} {shown(request.url.path)}: {exc.detail}",
                   code="not_found" if exc.status_code == 404 else "method_not_allowed")
    return JSONResponse(err.body(), status_code=exc.status_code)


async def _server_error(request: Request, exc: Exception) -> Response:
    err, ref = server_error(f"internal server error in {shown(request.method)} {shown(request.url.path)}",
                            "internal_error")
    log.error("k3c serve: unhandled error in %s %s (reference %s)", request.method, request.url.path, ref,
              exc_info=exc)
    return JSONResponse(err.body(), status_code=500)


def build_app(loop: EngineLoop, info: ModelInfo, metrics: ServerMetrics, api_key: str | None = None, *,
              body_timeout: float = BODY_TIMEOUT_S, max_body_bytes: int | None = None) -> Starlette:
    s = Server(loop, info, metrics, api_key, body_timeout=body_timeout, max_body_bytes=max_body_bytes)
    routes = [
        Route("/health", s.health, methods=["GET"]),
        Route("/metrics", s.metrics_text, methods=["GET"]),
        Route("/v1/models", s.models, methods=["GET"]),
        Route("/v1/completions", s.completions, methods=["POST"]),
        Route("/v1/chat/completions", s.chat, methods=["POST"]),
        Route("/tokenize", s.tokenize, methods=["POST"]),
        Route("/detokenize", s.detokenize, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _not_found, Exception: _server_error})
    app.state.server = s
    return app
