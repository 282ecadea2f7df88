"""Speculative decoding of requests with logit changes (serving/speculation.py, logits_processors.RowLogits):
constrained (xgrammar, the server's grammars) and penalized requests draft, and their acceptance is exact.

On the CPU in fp32 with the trained example model examples/k3-stdlib (kernels off), prompts that spell out the
schema's property names (prompt lookup finds them again in the output):
  - greedy JSON-schema output with speculation is the output without it, token for token, every one valid; drafts
    were verified and kept;
  - a drafter that proposes grammar-refused tokens (the model's unconstrained continuation, a wrong token spliced
    into the constrained one) has them cut before the call, and the output is still plain constrained output;
  - the masks at a draft's positions are those a matcher stepping through it gives, the grammar left as it was;
  - penalties and biases are applied per verified position: greedy penalized output with speculation is the output
    without it.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import sys

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from k3c.runtime.engine import Engine  # noqa: E402
from k3c.runtime.logits_processors import RowLogits, mask_words  # noqa: E402
from k3c.runtime.speculative import NgramDrafter, Speculation  # noqa: E402
from k3c.serve.grammar import Grammars  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, os.path.join(ROOT, "bench"))
from structured_outputs import random_schema  # noqa: E402

STDLIB = ROOT / "examples" / "k3-stdlib"
MAX_NEW = 256


@pytest.fixture(scope="module", autouse=True)
def _one_thread_module():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stdlib():
    from k3c.commands.run import _graph_weights, _load_model

    model = _load_model(str(STDLIB))
    w, _ = _graph_weights(model, str(STDLIB), 0, torch.float32, "cpu", lambda: None)
    return model, w


@pytest.fixture(scope="module")
def grammars(stdlib):
    model, _ = stdlib
    return Grammars(model.tokenizer, model.spec.vocab_size)


@pytest.fixture(scope="module")
def cases(stdlib, grammars):
    """(prompt ids, schema, compiled grammar) of a few random schemas."""
    model, _ = stdlib
    rng = random.Random(11)
    out = []
    for _ in range(3):
        schema = random_schema(rng)
        prompt = f"Answer in JSON with the keys {', '.join(schema['properties'])}: "
        out.append((model.tokenizer.encode(prompt), schema, grammars.json_schema(schema, "schema")))
    return out


def _engine(stdlib, speculation=None):
    model, w = stdlib
    return Engine(model, w, device="cpu", max_batch=3, max_context=384, use_kernels=False, speculation=speculation)


def _ngram(draft_len=4):
    return Speculation(NgramDrafter(), draft_len=draft_len, adaptive=False)


def _run(eng, reqs, max_new=MAX_NEW):
    """reqs: [(prompt, RowLogits)]: the generated tokens of each, run to the end."""
    eos = eng.compiled.tokenizer.eos_id
    rids = [eng.add_request(p, max_new, stop_token_ids=[eos], logits=proc) for p, proc in reqs]
    got = eng.run()
    return [got[r] for r in rids]


@pytest.fixture(scope="module")
def plain(stdlib, cases):
    """Greedy constrained output without speculation."""
    return _run(_engine(stdlib), [(p, RowLogits(grammar=g.matcher())) for p, _, g in cases])


def _valid(stdlib, tokens, schema):
    model, _ = stdlib
    eos = model.tokenizer.eos_id
    text = model.tokenizer.decode([t for t in tokens if t != eos])
    jsonschema.validate(json.loads(text), schema)


def test_greedy_constrained_with_speculation_is_plain_constrained(stdlib, cases, plain):
    for (_, schema, _), out in zip(cases, plain):
        _valid(stdlib, out, schema)
    eng = _engine(stdlib, _ngram())
    procs = [RowLogits(grammar=g.matcher()) for _, _, g in cases]
    got = _run(eng, [(p, proc) for (p, _, _), proc in zip(cases, procs)])
    assert got == plain
    assert eng.stats["spec_calls"] > 0 and eng.stats["spec_accepted"] > 0    # constrained rows drafted and kept
    assert not any(proc.grammar.failed for proc in procs)
    eng.pool.check_empty()


class Scripted:
    """Proposes, after each context, `bad(ctx, k)`: a draft of k tokens of its choosing."""

    name = "scripted"

    def __init__(self, bad):
        self.bad, self.proposed = bad, []

    def propose(self, contexts, ks):
        out = [self.bad(c, k) for c, k in zip(contexts, ks)]
        self.proposed += out
        return out

    def forget(self, rid):
        pass


def test_drafts_the_grammar_refuses_are_cut(stdlib, cases, plain):
    prompt, schema, g = cases[0]
    want = prompt + plain[0]
    free = _engine(stdlib).generate([prompt], 4)[0]          # unconstrained: not JSON (never seen any)
    assert free != plain[0][:4]

    def right_then_wrong(ctx, k):                   # the constrained continuation with its 2nd token replaced
        d = list(want[len(ctx):len(ctx) + k])
        if len(d) > 1:
            d[1] = free[0] if free[0] != d[1] else (d[1] + 1) % 4096
        return d

    def unconstrained(ctx, k):                      # the model's own continuation, which the grammar refuses
        return list(free[:k])

    for bad in (right_then_wrong, unconstrained):
        eng = _engine(stdlib, Speculation(Scripted(bad), draft_len=4, adaptive=False))
        got = _run(eng, [(prompt, RowLogits(grammar=g.matcher()))])
        assert got == [plain[0]], bad.__name__
        assert eng.stats["spec_grammar_cut"] > 0, bad.__name__
        assert eng.stats["spec_calls"] > 0
        eng.pool.check_empty()


def test_draft_masks_are_a_stepping_matchers(stdlib, cases, plain):
    _, _, g = cases[1]
    words = mask_words(stdlib[0].spec.vocab_size)
    proc = RowLogits(grammar=g.matcher())
    stepper = g.matcher()
    out = plain[1]
    for t in out[:3]:                                # both a few tokens in
        proc.accept(t)
        stepper.accept(t)
    draft = out[3:9]
    assert proc.draft_prefix(draft) == len(draft)
    assert proc.draft_prefix(draft[:2] + [4095] + draft[3:]) == 2       # refused at the third: cut there
    masks = torch.zeros(len(draft) + 1, words, dtype=torch.int32)
    proc.fill_draft_masks(draft, masks, 0)
    want = torch.zeros(len(draft) + 1, words, dtype=torch.int32)
    for j, t in enumerate(draft + [None]):
        stepper.fill_mask(want, j)
        if t is not None:
            stepper.accept(t)
    assert torch.equal(masks, want)
    mine = torch.zeros(1, words, dtype=torch.int32)       # left where it was: the mask after out[:3]
    proc.grammar.fill_mask(mine, 0)
    assert torch.equal(mine[0], masks[0])
    with pytest.raises(ValueError, match="draft_prefix"):
        proc.fill_draft_masks(draft[:1] + [4095], masks, 0)
    proc.grammar.fill_mask(mine, 0)
    assert torch.equal(mine[0], masks[0])


def test_penalized_and_biased_with_speculation_are_plain(stdlib, cases):
    model, _ = stdlib
    prompts = [model.tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"),
               model.tokenizer.encode("for i in range(10):\n    print(i)\nfor i in range(10):\n")]

    def procs():
        return [RowLogits(presence_penalty=0.4, frequency_penalty=0.3),
                RowLogits(repetition_penalty=1.2, logit_bias={model.tokenizer.encode(" ")[0]: -2.0})]

    want = _run(_engine(stdlib), list(zip(prompts, procs())), 48)
    eng = _engine(stdlib, _ngram())
    got = _run(eng, list(zip(prompts, procs())), 48)
    assert got == want
    assert eng.stats["spec_calls"] > 0 and eng.stats["spec_accepted"] > 0


def test_auto_tool_choice_a_started_call_is_valid(stdlib, grammars):
    """tool_choice "auto": free text, and once a section begins (here: the output so far began one, as a model
    that decided to call would) the model, which has never seen a call, completes valid calls; with speculation
    the same tokens."""
    from k3c.serve.tool_parser import SECTION_BEGIN, parse_whole

    model, _ = stdlib
    tok = model.tokenizer
    rng = random.Random(28)                          # two small schemas: a short call
    tools = [{"name": "pick", "parameters": random_schema(rng)}, {"name": "other", "parameters": random_schema(rng)}]
    g = grammars.tool_call_auto(tools, parallel=False)
    started = tok.encode("I will look it up. " + SECTION_BEGIN)
    prompt = tok.encode("Tools: pick, other. Call one.\n")

    def proc():
        c = g.matcher()
        for t in started:
            c.accept(t)
        assert not c.failed
        return RowLogits(grammar=c)

    outs = [_run(_engine(stdlib, spec), [(prompt + started, proc())])[0] for spec in (None, _ngram())]
    assert outs[0] == outs[1] and outs[0][-1] == tok.eos_id
    parsed = parse_whole(tok.decode(started + outs[0][:-1]))
    assert parsed["content"] == "I will look it up. " and len(parsed["tool_calls"]) == 1
    c = parsed["tool_calls"][0]
    jsonschema.validate(json.loads(c["arguments"]), next(t["parameters"] for t in tools if t["name"] == c["name"]))
    assert c["id"] == f"functions.{c['name']}:0"
