"""The one thread that owns the engine.

    loop = EngineLoop(engine, metrics, eos_id=tok.eos_id)
    loop.start()
    job = Job(index=0, prompt=ids, max_tokens=64, sampling=params, logprobs=None, events=queue, aloop=aloop)
    loop.submit(job)            # from the HTTP side (any thread): the request joins at the next step
    ...                         # job.events receives TokenEvent / ErrorEvent, put there from this thread
    loop.cancel(job)            # the client left or a stop string came: the sequence leaves at the next step
    loop.shutdown("server shutting down")    # every open job gets an ErrorEvent; the thread ends

HTTP handlers never touch the engine: they enqueue submissions and cancellations, which this thread applies
between steps, so the engine (its batch, page pool and prefix cache) is only ever changed by one thread. A request
whose token could not be chosen (the engine's StepOutput.error) fails alone (500); a step that raises fails the
jobs it was running (500) and the engine is cleared of them; the loop goes on. Either is counted in
k3c_choices_finished{reason="error"}, logged with its traceback and a reference, and the client is told what failed
and the reference, never the exception's text. Tokens, their log-probabilities and the timing metrics (TTFT,
inter-token latency) are taken here, as the engine produces them.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from .protocol import APIError

log = logging.getLogger("k3c.serve")


@dataclass
class TokenEvent:
    index: int                        # the choice
    token: int
    finished: bool                    # the engine ended the sequence (max_tokens or the EOS token)
    logprob: float | None = None      # of `token` under the model's distribution
    top: list[tuple[int, float]] | None = None     # the most likely alternatives (id, logprob)
    reason: str | None = None         # of a finished one: stop (the EOS token, or its grammar completed) | length


@dataclass
class ErrorEvent:
    index: int
    error: APIError


@dataclass(eq=False)
class Job:
    """One choice of one request: a prompt continued by the engine as one sequence."""
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: object                  # runtime.sampling.SamplingParams, seeded
    logprobs: int | None              # top alternatives to report per token; None: no log-probabilities
    events: asyncio.Queue
    aloop: asyncio.AbstractEventLoop
    t_arrival: float = field(default_factory=time.perf_counter)
    logits: object = None             # runtime.logits_processors.RowLogits (penalties, biases, grammar), or None
    rid: int | None = None
    seq: object = None                # the engine's SeqState (its `resumed` count outlives the sequence)
    tokens: int = 0
    t_last: float | None = None
    closed: bool = False              # nothing more will be sent to it

    def put(self, event) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:          # the HTTP loop has closed: nobody is listening
            pass


def server_error(what: str, code: str) -> tuple[APIError, str]:
    """A 500 naming what failed and a reference the log line carries; (the error, the reference)."""
    ref = uuid.uuid4().hex[:12]
    return APIError(500, f"{what}; the server log has the details (reference {ref})", type="server_error",
                    code=code), ref


class EngineLoop:
    def __init__(self, engine, metrics, *, eos_id: int | None, idle_wait: float = 0.05):
        self.engine, self.metrics, self.eos_id = engine, metrics, eos_id
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, Job] = {}          # engine rid -> job
        self._idle_wait = idle_wait
        self._stop_reason: str | None = None
        self._thread = threading.Thread(target=self._main, name="k3c-engine", daemon=True)
        self.steps = 0
        self.error: BaseException | None = None   # what ended the thread, when it was not shutdown()

    # -- the HTTP side ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self.metrics.observe_engine(self.engine)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._stop_reason is None

    def submit(self, job: Job) -> None:
        if not self.alive:
            raise APIError(503, "the server is shutting down", type="server_error", code="unavailable")
        self._inbox.put(("add", job))

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """The job's sequence leaves at the next step; `reason` labels it in the metrics (cancelled: the client
        left; stop: a stop string ended it)."""
        self._inbox.put(("cancel", (job, reason)))

    def shutdown(self, reason: str = "the server is shutting down", timeout: float | None = 30.0) -> None:
        """Stop: every open job gets an ErrorEvent (503), every sequence leaves the engine, the thread ends."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._inbox.put(("wake", None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def fail_open(self, reason: str) -> None:
        """From any thread, when the engine cannot go on and its thread may be blocked (a rank of a sharded model
        died or hangs): new requests get 503 from here on, every open job gets a 503 ErrorEvent now. The engine is
        not touched."""
        if self._stop_reason is None:
            self._stop_reason = reason
        error = APIError(503, reason, type="server_error", code="unavailable")
        for job in list(self._jobs.values()):
            if not job.closed:
                self._close(job, ErrorEvent(job.index, error))
                self.metrics.finished.labels("error").inc()

    # -- the engine thread --------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while self._stop_reason is None:
                # nothing running (at most requests waiting for room, which time or a new request may give them):
                # wait for the inbox a while instead of spinning on admission attempts
                self._drain(block=not self.engine.running)
                if self._stop_reason is None and self.engine.has_work():
                    self._step()
        except BaseException as exc:             # a bug of the loop itself: say so, fail everyone, end
            ref = uuid.uuid4().hex[:12]
            if getattr(exc, "fatal", False):     # a rank failed: its cause is the message, not this thread's stack
                log.error("k3c serve: %s (reference %s)", exc, ref)
            else:
                log.exception("k3c serve: the engine loop failed (reference %s)", ref)
            self.error = exc
            what = "a rank of the sharded model failed" if getattr(exc, "fatal", False) else "the engine loop failed"
            self._stop_reason = self._stop_reason or f"{what} (reference {ref})"
        finally:
            self._drain(block=False)
            self._fail_all(APIError(503, self._stop_reason or "the server is shutting down", type="server_error",
                                    code="unavailable"), "error" if self.error is not None else "shutdown")

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, what: str, job) -> None:
        if what == "add":
            if self._stop_reason is not None:
                self._close(job, ErrorEvent(job.index, APIError(503, self._stop_reason, type="server_error",
                                                                code="unavailable")))
                return
            try:
                job.rid = self.engine.add_request(list(job.prompt), job.max_tokens, sampling=job.sampling,
                                                  stop_token_ids=() if self.eos_id is None else (self.eos_id,),
                                                  logits=job.logits)
            except UserError as exc:       # larger than the whole pool, or a bad argument
                self._close(job, ErrorEvent(job.index, APIError(400, str(exc))))
                return
            job.seq = self.engine.seqs[job.rid]
            self._jobs[job.rid] = job
        elif what == "cancel":
            job, reason = job
            if job.rid is not None and self._jobs.get(job.rid) is job:
                del self._jobs[job.rid]
                self.engine.finish(job.rid)
                self.metrics.finished.labels(reason).inc()
            job.closed = True

    def _close(self, job: Job, event) -> None:
        job.closed = True
        job.put(event)

    def _fail_all(self, error: APIError, reason: str) -> None:
        """Every open job ends with `error`, counted as finished for `reason` (an engine error: nothing of its
        sequences is checkpointed, their state may be what failed)."""
        for rid, job in list(self._jobs.items()):
            if rid in self.engine.seqs:
                self.engine.finish(rid, checkpoint=reason != "error")
            if not job.closed:                   # fail_open may have told it already
                self._close(job, ErrorEvent(job.index, error))
                self.metrics.finished.labels(reason).inc()
        self._jobs.clear()
        self.metrics.observe_engine(self.engine)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as exc:                 # the step's sequences cannot go on; the server can
            if getattr(exc, "fatal", False):     # not a sharded engine's (a rank failed): the loop ends, 503
                raise
            error, ref = server_error("the engine step running this request failed", "engine_error")
            log.exception("k3c serve: an engine step failed (reference %s)", ref)
            self._fail_all(error, "error")
            return
        self.steps += 1
        now = time.perf_counter()
        m = self.metrics
        if outs:                                 # sequences stepped (speculation emits several tokens each)
            m.batch.observe(len({o.rid for o in outs}))
        for o in outs:
            job = self._jobs.get(o.rid)
            if job is None:
                continue
            if o.error is not None:              # this request alone failed; it has left the engine
                error, ref = server_error("choosing this request's next token failed", "engine_error")
                log.error("k3c serve: sampling a token of request %s failed (reference %s)", o.rid, ref,
                          exc_info=o.error)
                del self._jobs[o.rid]
                m.finished.labels("error").inc()
                self._close(job, ErrorEvent(job.index, error))
                continue
            job.tokens += 1
            m.generated_tokens.inc()
            if job.t_last is None:
                m.ttft.observe(now - job.t_arrival)
                m.prompt_tokens.inc(len(job.prompt))
                m.cached_tokens.inc(getattr(job.seq, "resumed", 0))
                admitted = getattr(job.seq, "t_admitted", None)
                if admitted is not None:
                    m.queue_time.observe(max(0.0, admitted - job.t_arrival))
            else:
                m.itl.observe(now - job.t_last)
            job.t_last = now
            event = TokenEvent(job.index, o.token, o.finished)
            if job.logprobs is not None:
                lp = torch.log_softmax(o.logits.float(), -1)
                event.logprob = float(lp[o.token])
                if job.logprobs:
                    top = lp.topk(job.logprobs)
                    event.top = list(zip(top.indices.tolist(), top.values.tolist()))
            if o.finished:
                del self._jobs[o.rid]
                m.latency.observe(now - job.t_arrival)
                done = o.token == self.eos_id or (job.logits is not None and job.logits.finished)
                event.reason = "stop" if done else "length"
                m.finished.labels(event.reason).inc()
                job.closed = True
            job.put(event)
        m.observe_engine(self.engine)
