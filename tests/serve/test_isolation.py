"""One request's sampling failure fails that request only: the engine gives it an error output and drops it, every
other row of the step draws the token it draws without it (same uniform numbers), and the engine loop answers the
failed request with a 500 that names what failed (not the exception's text) and counts it as finished by error.

The failure is injected into the sampler for the rows of one marked request (top_k 13), so the test does not
depend on which inputs a real sampler refuses; tests/serve/test_hostile_clients.py sends the real hostile values.
"""
import asyncio

import pytest
import torch

import k3c.runtime.sampling as sampling
from k3c.runtime.engine import Engine
from k3c.runtime.sampling import SamplingParams
from k3c.serve.engine_loop import EngineLoop, ErrorEvent, Job, TokenEvent
from k3c.serve.metrics import ServerMetrics

MARK = 13                                    # the top_k of the request whose sampling fails
SECRET = "injected failure: internal detail"


@pytest.fixture
def failing_row(monkeypatch):
    real = sampling._sorted_filtered

    def sorted_filtered(logits, params):
        if any(p.top_k == MARK for p in params):
            raise RuntimeError(SECRET)
        return real(logits, params)

    monkeypatch.setattr(sampling, "_sorted_filtered", sorted_filtered)


def _requests(spec):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    params = [None, SamplingParams(1.0, top_p=0.9, seed=11), SamplingParams(1.0, top_k=MARK, seed=12),
              SamplingParams(0.8, top_k=20, seed=13)]
    return prompts, params


def _engine(tiny):
    spec, model, w = tiny
    return Engine(model, w, use_kernels=False, max_batch=4, max_context=64, page_size=8)


def _drive(eng, prompts, params, rows):
    """{row: tokens} and {row: error} of the given rows, added together and stepped to the end."""
    rids = {eng.add_request(prompts[i], 6, sampling=params[i]): i for i in rows}
    tokens, errors = {i: [] for i in rows}, {}
    while eng.has_work():
        for o in eng.step():
            if o.error is not None:
                errors[rids[o.rid]] = o.error
                assert o.finished and o.rid not in eng.seqs
            else:
                tokens[rids[o.rid]].append(o.token)
    return tokens, errors


def test_a_failing_row_fails_alone_and_the_others_draw_the_same(tiny, one_thread, failing_row):
    spec = tiny[0]
    prompts, params = _requests(spec)
    alone, none = _drive(_engine(tiny), prompts, params, [0, 1, 3])
    assert none == {}
    eng = _engine(tiny)
    free = eng.pool.num_free
    got, errors = _drive(eng, prompts, params, [0, 1, 2, 3])
    assert set(errors) == {2} and SECRET in str(errors[2])
    assert got[2] == []                                         # it failed at its first token
    assert {i: got[i] for i in (0, 1, 3)} == alone              # sampled rows too: their draws are unchanged
    assert eng.pool.num_free == free and not eng.seqs           # its pages came back


def test_sample_rows_keeps_every_other_rows_draw(failing_row):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(1.0, seed=1), SamplingParams(1.0, top_k=MARK, seed=2), sampling.GREEDY,
              SamplingParams(0.7, top_p=0.8, seed=3)]
    gens = [sampling.make_generator(p) if not p.greedy else None for p in params]
    got = sampling.sample_rows(logits, params, gens)
    assert isinstance(got[1], RuntimeError)
    keep = [0, 2, 3]
    gens = [sampling.make_generator(params[i]) if not params[i].greedy else None for i in keep]
    want = sampling.sample(logits[keep], [params[i] for i in keep], gens).tolist()
    assert [got[i] for i in keep] == want


def test_the_engine_loop_answers_the_failed_request_alone(tiny, one_thread, failing_row):
    spec = tiny[0]
    prompts, params = _requests(spec)
    alone, _ = _drive(_engine(tiny), prompts, params, [0, 1, 3])
    metrics = ServerMetrics()
    loop = EngineLoop(_engine(tiny), metrics, eos_id=None)

    async def main():
        aloop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in prompts]
        jobs = [Job(index=0, prompt=tuple(p), max_tokens=6, sampling=sampling.params_for_rows(s, 1)[0], logprobs=None,
                    events=q, aloop=aloop) for p, s, q in zip(prompts, params, queues)]
        for job in jobs:
            loop.submit(job)
        out = {}
        for i, q in enumerate(queues):
            toks = []
            while True:
                ev = await asyncio.wait_for(q.get(), 120)
                if isinstance(ev, ErrorEvent):
                    out[i] = ev.error
                    break
                assert isinstance(ev, TokenEvent)
                toks.append(ev.token)
                if ev.finished:
                    out[i] = toks
                    break
        return out

    loop.start()
    try:
        out = asyncio.run(main())
    finally:
        loop.shutdown()
    err = out[2]
    assert err.status == 500 and err.code == "engine_error" and err.type == "server_error"
    assert "next token" in err.message and "reference" in err.message
    assert SECRET not in err.message and "RuntimeError" not in err.message
    assert {i: out[i] for i in (0, 1, 3)} == alone
    finished = {s.labels["reason"]: s.value for fam in metrics.registry.collect() if fam.name == "k3c_choices_finished"
                for s in fam.samples if s.name.endswith("_total")}
    assert finished == {"error": 1.0, "length": 3.0}


def test_a_failing_verification_fails_its_request_alone(one_thread, monkeypatch):
    """With speculative decoding a sampled row's tokens come from accept_sampled in the verification: a failure
    there drops that row and its drafts; the greedy rows verified in the same call keep their exact tokens."""
    import pathlib

    import k3c.runtime.speculative as speculative
    from k3c.commands.run import _graph_weights, _load_model
    from k3c.runtime.speculative import NgramDrafter, Speculation

    stdlib = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "k3-stdlib")
    model = _load_model(stdlib)
    w, _ = _graph_weights(model, stdlib, 0, torch.float32, "cpu", lambda: None)
    text = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\n"
    prompts = [model.tokenizer.encode(text), model.tokenizer.encode("import os\nimport sys\nimport os\n"),
               model.tokenizer.encode(text + "x = 1\n")]
    marked = SamplingParams(1e-4, top_k=MARK, seed=3)
    real, calls = speculative.accept_sampled, []

    def accept_sampled(logits, drafts, params, gen):
        calls.append(params.top_k)
        if params.top_k == MARK:
            raise RuntimeError(SECRET)
        return real(logits, drafts, params, gen)

    monkeypatch.setattr(speculative, "accept_sampled", accept_sampled)

    def run(rows, speculate):
        spec = Speculation(NgramDrafter(), draft_len=4, adaptive=False) if speculate else None
        eng = Engine(model, w, device="cpu", max_batch=4, max_context=128, use_kernels=False, speculation=spec)
        return _drive(eng, prompts, [None, None, marked], rows)

    plain, _ = run([0, 1], speculate=False)
    got, errors = run([0, 1, 2], speculate=True)
    assert MARK in calls, "the marked row was never verified: the test does not reach accept_sampled"
    assert set(errors) == {2} and SECRET in str(errors[2])
    assert {i: got[i] for i in (0, 1)} == plain


def test_an_unhandled_error_is_a_500_without_its_text(caplog):
    """A bug in a handler: the client's 500 says what failed and gives a reference; the log line with that reference
    holds the traceback and the exception's text."""
    import json
    import re

    from k3c.serve.app import build_app
    from k3c.serve.protocol import ModelInfo

    class BrokenLoop:
        eos_id, alive = None, True

        def submit(self, job):
            raise RuntimeError(SECRET)

    info = ModelInfo(name="m", tokenizer=None, max_context=64, vocab_size=100, render_chat=lambda m, tools=None: "")
    app = build_app(BrokenLoop(), info, ServerMetrics())
    sent = []

    async def call():
        body = [{"type": "http.request", "body": b'{"model": "m", "prompt": [1, 2], "max_tokens": 2}',
                 "more_body": False}]

        async def receive():
            return body.pop(0) if body else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 9),
                 "server": ("127.0.0.1", 80)}
        try:
            await app(scope, receive, send)
        except RuntimeError:                     # Starlette re-raises it for the server's own log, after the 500
            pass

    asyncio.run(call())
    assert sent[0]["status"] == 500
    err = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert err["code"] == "internal_error" and "POST /v1/completions" in err["message"]
    assert SECRET not in err["message"] and "RuntimeError" not in err["message"]
    ref = re.search(r"reference ([0-9a-f]{12})", err["message"]).group(1)
    logged = [r for r in caplog.records if ref in r.getMessage()]
    assert logged and SECRET in str(logged[0].exc_info[1])
