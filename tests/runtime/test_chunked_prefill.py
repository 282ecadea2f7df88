"""Chunked prefill under a step token budget (Engine(max_step_tokens=..., itl_target_ms=...)): greedy output through
chunked prefill equals whole-prompt prefill token for token (fp32, k3-tiny) for every chunk size, with boundaries
across KDA sub-chunks, MLA pages and prefix-cache checkpoints, and with decoding rows beside the chunks; a step's
prefill projects only the last position; the budget and the latency rule decide each step's tokens as documented."""
import pytest
import torch

from k3c.errors import ArgumentError
from k3c.runtime.engine import Engine
from k3c.runtime.prefix_cache import PrefixCache
from k3c.runtime.serving.scheduler import PREFILL_FLOOR, StepBudget
from numerics import rel

PROMPT_LEN = 21          # past the 16-token KDA sub-chunk and two MLA pages of 8
NEW = 3


@pytest.fixture(scope="module")
def graph(tiny):
    """One loaded graph shared by the module's engines (loading it is most of an engine's cost)."""
    spec, model, w = tiny
    return Engine(model, w, use_kernels=False, max_context=64, page_size=8).graph


def engine(tiny, graph, **kw):
    spec, model, w = tiny
    kw.setdefault("max_context", 64)
    kw.setdefault("page_size", 8)
    return Engine(model, w, use_kernels=False, graph=graph, **kw)


def prompts(spec, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]


def serve(eng, ps, new=NEW, joins=None):
    """Step until done: ({prompt index: [StepOutput]}, [each step's (decode_tokens, prefill_tokens)]). joins: prompt
    index -> the step before which it is added (default: all at once)."""
    joins = joins or {i: 0 for i in range(len(ps))}
    rids, outs, plans, step = {}, {}, [], 0
    while step == 0 or eng.has_work() or len(rids) < len(ps):
        for i, at in joins.items():
            if at == step:
                rids[eng.add_request(ps[i], new)] = i
        for o in eng.step():
            outs.setdefault(rids[o.rid], []).append(o)
        plans.append((eng.last_plan.decode_tokens, eng.last_plan.prefill_tokens))
        step += 1
    return outs, plans


def assert_same(got, want):
    assert set(got) == set(want)
    for i in want:
        assert [o.token for o in got[i]] == [o.token for o in want[i]]
        # fp32 through another chunking of the same tokens: a reordering of reductions (1.1e-5 measured)
        assert rel(torch.stack([o.logits for o in got[i]]), torch.stack([o.logits for o in want[i]])) <= 2e-5


def test_every_chunk_size_gives_the_whole_prefill_output(tiny, graph, one_thread):
    spec = tiny[0]
    ps = prompts(spec, (PROMPT_LEN,), seed=3)
    whole, plans = serve(engine(tiny, graph), ps)
    assert plans[0] == (0, PROMPT_LEN)
    for chunk in range(1, PROMPT_LEN + 1):
        eng = engine(tiny, graph, max_step_tokens=chunk)
        got, plans = serve(eng, ps)
        assert_same(got, whole)
        prefill = [p for d, p in plans if p]
        assert prefill == [chunk] * (PROMPT_LEN // chunk) + ([PROMPT_LEN % chunk] if PROMPT_LEN % chunk else [])
        assert eng.stats["prefill_tokens"] + eng.stats["decode_tokens"] == PROMPT_LEN + NEW - 1


def test_chunks_across_prefix_checkpoints_and_a_resumed_prompt(tiny, graph, one_thread):
    """Chunks cut at checkpoint boundaries (interval 8, pages of 8), and a second prompt that resumes from a
    checkpoint of the first and chunks the rest: the outputs of a cold whole-prompt engine."""
    spec = tiny[0]
    base, tail = prompts(spec, (PROMPT_LEN, 10), seed=4)
    ps = [base, base[:13] + tail]                         # shares 13 tokens: resumes at the checkpoint of 8
    cold = {}
    for i, p in enumerate(ps):
        cold[i] = serve(engine(tiny, graph), [p])[0][0]
    for chunk in (3, 5, 7, 16):
        pc = PrefixCache(interval=8)
        eng = engine(tiny, graph, max_step_tokens=chunk, prefix_cache=pc, num_pages=32)
        got = {i: serve(eng, [p])[0][0] for i, p in enumerate(ps)}
        assert_same(got, cold)
        assert not eng.seqs and pc.stats["hits"] == 1


@pytest.mark.parametrize("packed", [True, False])
def test_decoding_rows_and_chunks_share_steps_and_calls(tiny, graph, one_thread, packed):
    """Two requests decode while two longer prompts arrive; with a budget of 4 every step runs the decoding rows
    and a chunk, in one packed call (packed_steps) or one call per segment length; with a budget of (decoding rows
    + 1) the chunks are one token and share the decode call."""
    spec = tiny[0]
    ps = prompts(spec, (5, 6, PROMPT_LEN, 17), seed=5)
    joins = {0: 0, 1: 0, 2: 3, 3: 4}
    new = 8
    whole, _ = serve(engine(tiny, graph, max_batch=4, packed_steps=False), ps, new, joins)
    for budget in (4, 7, 3):
        eng = engine(tiny, graph, max_batch=4, max_step_tokens=budget, packed_steps=packed)
        got, plans = serve(eng, ps, new, joins)
        assert_same(got, whole)
        mixed = [(d, p) for d, p in plans if d and p]
        assert mixed and all(p <= max(budget - d, min(PREFILL_FLOOR, budget)) for d, p in plans)
        calls = sum(eng.stats[f"{k}_calls"] for k in ("decode", "prefill", "mixed"))
        if packed:      # one call a step; a step is mixed when its rows' lengths differ
            assert calls == sum(1 for d, p in plans if d + p) and eng.stats["mixed_calls"] > 0
        else:
            assert calls > sum(1 for d, p in plans if d + p) and eng.stats["mixed_calls"] == 0


def test_a_packed_call_equals_its_rows_run_apart(tiny, graph, one_thread):
    """Rows of unequal lengths (fresh prompts, a resumed prompt, a decode row) in one packed call through extend():
    each row's logits and the states it leaves equal those of the rows run one call per length (fp32)."""
    spec = tiny[0]
    ps = prompts(spec, (9, 4, 13, 6, 1), seed=8)
    out = {}
    for packed in (True, False):
        eng = engine(tiny, graph, max_batch=5, packed_steps=packed)
        rids = [eng.open() for _ in ps]
        eng.extend(rids[2:4], [ps[2][:5], ps[3][:5]])      # two rows with cached context
        eng.extend(rids[4:], [ps[4]])
        counted = sum(eng.mode_counts.values())
        first = eng.extend(rids, [ps[0], ps[1], ps[2][5:], ps[3][5:], ps[1][:1]])
        counted = sum(eng.mode_counts.values()) - counted
        again = eng.extend(rids, [[7]] * len(rids))         # the states and pages each row left
        out[packed] = (first, again, eng.stats["mixed_calls"])
        # an MLA mode counted per group of equal lengths (9, 8, 4, 1 tokens), as the calls run apart count them
        assert counted == 4 * len(eng.mla_layers) > 0
    assert out[True][2] == 1 and out[False][2] == 0
    for got, want in zip(out[True][0] + out[True][1], out[False][0] + out[False][1]):
        assert got.shape == want.shape and rel(got, want) <= 2e-5


def test_one_token_chunks_share_the_decode_call(tiny, graph, one_thread):
    spec = tiny[0]
    ps = prompts(spec, (4, 9), seed=6)
    whole, _ = serve(engine(tiny, graph, max_batch=2), ps, 6, {0: 0, 1: 2})
    eng = engine(tiny, graph, max_batch=2, max_step_tokens=1)
    got, plans = serve(eng, ps, 6, {0: 0, 1: 2})
    assert_same(got, whole)
    # the floor (min(PREFILL_FLOOR, 1) = 1) gives the prompt one token beside the decoding row: T=1 both, one call
    assert (1, 1) in plans
    assert eng.stats["prefill_calls"] == 0 and eng.stats["decode_calls"] == sum(1 for d, p in plans if d + p)


def test_a_step_projects_only_the_last_position(tiny, graph, one_thread):
    """The step's prefill call computes lm_head on one row per sequence; extend() (prompt logits) keeps all."""
    spec = tiny[0]
    (p,) = prompts(spec, (11,), seed=7)
    eng = engine(tiny, graph)
    a, b = eng.open(), eng.open()
    full = eng.extend([a], [p])[0]
    assert full.shape == (11, spec.vocab_size)
    seq = eng.seqs[b]
    seq.tokens.extend(p)
    last = eng.runner.run([(seq, list(p))], evict=True, all_positions=False)[b]
    assert last.shape == (1, spec.vocab_size)
    assert rel(last[0], full[-1]) <= 1e-6


def test_budget_room_and_latency_rule():
    b = StepBudget(max_tokens=64)
    assert b.prefill_room(0) == 64 and b.prefill_room(10) == 54
    assert b.prefill_room(100) == PREFILL_FLOOR                     # prompts never starve
    assert StepBudget(max_tokens=4).prefill_room(10) == 4            # the floor is no more than the budget
    assert StepBudget().prefill_room(5) == float("inf")
    t = StepBudget(max_tokens=1000, itl_target=0.050)
    assert t.prefill_room(8) == 992                                  # nothing measured yet: the cap's room
    t.observe(8, 0, 0.010)                                           # a decode-only step: 10 ms
    t.observe(8, 400, 0.090)                                         # 80 ms for 400 prompt tokens: 0.2 ms each
    assert t.prefill_room(8) == 200                                  # (50 - 10) ms / 0.2 ms
    assert t.prefill_room(0) == 1000                                 # nobody decodes: no latency to keep
    t.observe(0, 500, 5.0)                                           # no decoding rows: no sample (no sync)
    assert t.prefill_room(8) == 200
    slow = StepBudget(itl_target=0.005)
    slow.observe(4, 0, 0.010)
    slow.observe(4, 10, 0.020)
    assert slow.prefill_room(4) == PREFILL_FLOOR                     # a target below the decode step: the floor


def test_latency_target_limits_chunks_on_a_running_engine(tiny, graph, one_thread):
    """With costs measured, a step beside decoding rows takes no more prompt tokens than the target leaves."""
    spec = tiny[0]
    eng = engine(tiny, graph, max_batch=2, max_step_tokens=64, itl_target_ms=1000.0)
    eng.scheduler.budget.decode_s, eng.scheduler.budget.token_s = 0.5, 0.5 / 20      # 20 tokens fit
    ps = prompts(spec, (4, 50), seed=8)
    whole, _ = serve(engine(tiny, graph, max_batch=2), ps, 4, {0: 0, 1: 2})
    eng.scheduler.budget.observe = lambda *a: None                                    # keep the costs set above
    got, plans = serve(eng, ps, 4, {0: 0, 1: 2})
    assert_same(got, whole)
    # beside the decoding row: 20 tokens a step; once it has finished, the rest of the prompt at once (the cap's room)
    assert [(d, p) for d, p in plans if p] == [(0, 4), (1, 20), (1, 20), (0, 10)]


@pytest.mark.parametrize("kw, msg", [
    ({"max_step_tokens": 0}, "max_step_tokens must be a positive integer"),
    ({"max_step_tokens": 2.5}, "max_step_tokens must be a positive integer"),
    ({"max_step_tokens": True}, "max_step_tokens must be a positive integer"),
    ({"itl_target_ms": 0}, "itl_target_ms must be a positive number"),
    ({"itl_target_ms": float("nan")}, "itl_target_ms must be a positive number"),
    ({"itl_target_ms": "50"}, "itl_target_ms must be a positive number"),
])
def test_bad_budget_arguments(tiny, graph, kw, msg):
    with pytest.raises(ArgumentError, match=msg):
        engine(tiny, graph, **kw)
