"""Per-request logit changes, batched: penalties and biases against per-row rules (transformers' for the
repetition penalty), grammar masks on their own rows only, and in the engine: constrained and free requests in one
batch, the free ones unchanged (speculative drafting under a grammar: test_speculative_grammar.py)."""
import math

import pytest
import torch

from k3c.errors import ArgumentError
from k3c.runtime.engine import Engine
from k3c.runtime.logits_processors import RowLogits, process, unpack_bitmask


class AllowOnly:
    """A stand-in grammar: only `allowed` tokens, finished after `length` tokens."""

    def __init__(self, allowed, length=10**9):
        self.allowed, self.length, self.seen = set(allowed), length, []

    def fill_mask(self, bitmask, row):
        for t in self.allowed:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)

    def accept(self, token):
        assert token in self.allowed
        self.seen.append(token)

    @property
    def finished(self):
        return len(self.seen) >= self.length


def _reference(row, proc, context, prompt_len):
    row = row.clone().float()
    if proc.repetition != 1.0:
        for t in set(context):
            row[t] = row[t] / proc.repetition if row[t] > 0 else row[t] * proc.repetition
    gen = context[prompt_len:]
    for t in set(gen):
        row[t] -= proc.presence + proc.frequency * gen.count(t)
    for t, b in proc.bias.items():
        row[t] += b
    return row


def test_penalties_and_biases_batched_equal_per_row_rules():
    g = torch.Generator().manual_seed(0)
    V = 97
    logits = torch.randn(5, V, generator=g) * 3
    procs = [RowLogits(presence_penalty=0.5, frequency_penalty=0.25), None,
             RowLogits(repetition_penalty=1.3, logit_bias={3: 5.0, 96: -100.0}),
             RowLogits(repetition_penalty=0.7, presence_penalty=-1.0, frequency_penalty=2.0, logit_bias={0: 1.5}),
             RowLogits()]
    contexts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 4, 13, 17, 3)]
    prompt_lens = [4, 2, 6, 5, 1]
    out = process(logits, procs, contexts, prompt_lens)
    for i, p in enumerate(procs):
        want = logits[i] if p is None else _reference(logits[i], p, contexts[i], prompt_lens[i])
        assert torch.allclose(out[i], want, atol=1e-5), i


def test_repetition_penalty_is_transformers_rule():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 50, generator=g)
    ids = torch.randint(0, 50, (2, 12), generator=g)
    want = transformers.RepetitionPenaltyLogitsProcessor(1.4)(ids, logits.clone())
    got = process(logits, [RowLogits(repetition_penalty=1.4)] * 2, ids.tolist(), [12, 12])
    assert torch.allclose(got, want, atol=1e-6)


def test_grammar_mask_touches_its_row_only():
    logits = torch.randn(3, 70)
    procs = [None, RowLogits(grammar=AllowOnly({2, 33, 69})), None]
    out = process(logits, procs, [[1], [1], [1]], [1, 1, 1])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert finite == [2, 33, 69]
    assert torch.equal(out[1][finite], logits[1][finite])


def test_unpack_bitmask_bit_order():
    words = torch.tensor([[1 - 2**31, 0, 4]], dtype=torch.int32)     # bits 0 and 31; bit 2 of word 2
    assert unpack_bitmask(words, 70).nonzero()[:, 1].tolist() == [0, 31, 66]


@pytest.mark.parametrize("kw", [{"presence_penalty": 3}, {"frequency_penalty": math.nan}, {"repetition_penalty": 0},
                                {"logit_bias": {1: 101}}])
def test_bad_values_are_refused(kw):
    with pytest.raises(ArgumentError):
        RowLogits(**kw)


def test_engine_batches_constrained_and_free_requests(tiny):
    spec, model, w = tiny
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (7, 11, 5)]

    def run(reqs):
        eng = Engine(model, w, use_kernels=False, max_batch=3, max_context=64, page_size=8)
        rids = [eng.add_request(p, 6, logits=proc) for p, proc in reqs]
        outs = {r: [] for r in rids}
        while eng.has_work():
            for o in eng.step():
                outs[o.rid].append(o.token)
        return [outs[r] for r in rids]

    alone = [run([(p, None)])[0] for p in prompts]
    allowed = {5, 9, 17}
    grammar = AllowOnly(allowed, length=4)
    mixed = run([(prompts[0], None), (prompts[1], RowLogits(grammar=grammar)), (prompts[2], None)])
    assert mixed[0] == alone[0] and mixed[2] == alone[2]        # the free rows are untouched
    assert set(mixed[1]) <= allowed and len(mixed[1]) == 4          # constrained; ends when its grammar does
    assert grammar.seen == mixed[1]


def test_engine_refuses_a_wrong_logits_argument(tiny):
    spec, model, w = tiny
    eng = Engine(model, w, use_kernels=False, max_batch=1, max_context=32, page_size=8)
    with pytest.raises(ArgumentError, match="RowLogits"):
        eng.add_request([1, 2], 2, logits={"presence_penalty": 1})
