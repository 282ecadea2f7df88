"""Speculative decoding (runtime/speculative.py, runtime/caches/kda_rollback.py, serving/speculation.py, Engine.rewind).

On the CPU in fp32 with the trained example model examples/k3-stdlib (kernels off) unless a test says otherwise:
  - greedy identity: with speculation (prompt lookup, then a draft model: the same model, and a random one that
    is nearly always wrong) the engine emits plain greedy decoding's tokens, token for token, under continuous
    batching, stop tokens and small max_new_tokens (the draft caps);
  - rollback exactness: after a partly rejected draft each KDA layer's state and conv tails and the MLA rows of the
    sequence are those of a fresh engine that consumed only the kept tokens; `restore` against the KDA layers
    stepped token by token;
  - the page pool: pages held / free after every step are plain decoding's at the same lengths, the admission
    reserve is neither leaked nor overdrawn, every page comes back;
  - sampling: rejection sampling (accept_sampled) emits tokens distributed as plain sampling's (chi-square at
    p > 1e-4, with negative controls that must fail it); greedy rows batched with sampled ones stay exact;
  - the verification CUDA-graph path with the stand-in capture backend (kernels, Triton interpreter, tiny model).
"""
from __future__ import annotations

import math
import pathlib
from collections import Counter

import pytest
import torch

import k3c
from k3c.errors import ArgumentError
from k3c.frontend import parse_spec_text
from k3c.runtime.engine import Engine
from k3c.runtime.sampling import SamplingParams, filtered_probs
from k3c.runtime.caches.seq_state import row_state
from k3c.runtime.speculative import (DraftModelDrafter, NgramDrafter, Speculation, accept_greedy,
                                     accept_sampled)

ROOT = pathlib.Path(__file__).resolve().parents[2]
STDLIB = ROOT / "examples" / "k3-stdlib"
MAX_NEW = 40                 # the plain reference's length per prompt (every run here emits a prefix of it)
CTX = 512

# Python snippets: spans that repeat (a function, then the start of the same function again) and some without
SNIPPETS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.read()\n\n\ndef read(path):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\nclass Point:\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "x = 1\n",
    "import json\n\n\ndef load(path):\n",
    "squares = [x * x for x in range(10)]\ncubes = [x * x * x for x in range(10)]\nsquares = [",
    '"""Utilities for parsing command line arguments."""\n',
    "config = {\n    'name': 'demo',\n    'size': 10,\n}\nconfig = {\n    'name':",
    "try:\n    import numpy as np\nexcept ImportError:\n    np = None\ntry:\n    import",
]


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b| (fp32; 0 when both are zero)."""
    a, b = a.double(), b.double()
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale else float((a - b).abs().max())


def _states(ref) -> tuple[torch.Tensor, ...]:
    st = row_state(ref)
    return (st.state, *st.conv)


# ---- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread_module():
    """Single-threaded torch for the whole module (as conftest's one_thread): thousands of small ops, which run
    many times slower with OpenMP threads contending on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stdlib():
    """(compiled example model, its fp32 weights prepared as `k3c run` prepares them)."""
    from k3c.commands.run import _graph_weights, _load_model

    model = _load_model(str(STDLIB))
    w, _ = _graph_weights(model, str(STDLIB), 0, torch.float32, "cpu", lambda: None)
    return model, w


@pytest.fixture(scope="module")
def prompts(stdlib):
    model, _ = stdlib
    out = [model.tokenizer.encode(s) for s in SNIPPETS]
    assert len({len(p) for p in out}) > 4            # different lengths share calls
    return out


def engine(stdlib, speculation=None, **kw):
    model, w = stdlib
    kw = {"device": "cpu", "max_batch": 4, "max_context": CTX, "use_kernels": False, **kw}
    return Engine(model, w, speculation=speculation, **kw)


@pytest.fixture(scope="module")
def reference(stdlib, prompts):
    """Plain greedy decoding of every prompt (MAX_NEW tokens), batched continuously, no speculation."""
    eng = engine(stdlib)
    got = eng.generate(prompts, MAX_NEW)
    eng.pool.check_empty()
    return got


def ngram(draft_len: int, buckets=(), **kw) -> Speculation:
    return Speculation(NgramDrafter(**kw), draft_len=draft_len, adaptive=False, buckets=buckets)


def run_requests(eng, prompts, news, sampling=None, stop=()):
    """add_request each prompt (its own max_new_tokens) and run to the end: the generated tokens per request."""
    sampling = sampling or [None] * len(prompts)
    rids = [eng.add_request(p, n, sampling=s, stop_token_ids=stop) for p, n, s in zip(prompts, news, sampling)]
    got = eng.run()
    return [got[r] for r in rids]


class ScriptedDrafter:
    """A drafter that knows the target's greedy continuation of each prompt: it proposes it with the token at
    index `good` of each draft replaced by a wrong one (None: the whole draft right), so every verification keeps
    exactly `good` drafts (when the draft is longer than that) and rolls the rest back."""

    name = "scripted"

    def __init__(self, scripts, vocab: int):
        self.scripts = [(list(p), list(p) + list(c), g) for p, c, g in scripts]
        self.vocab = vocab
        self.proposed = 0

    def propose(self, contexts, ks):
        out = []
        for ctx, k in zip(contexts, ks):
            p, full, good = next(s for s in self.scripts if ctx[:len(s[0])] == s[0])
            d = full[len(ctx):len(ctx) + k]
            if good is not None and len(d) > good:
                d[good] = (d[good] + 1) % self.vocab
            out.append(d)
            self.proposed += len(d)
        return out

    def forget(self, rid):
        pass


# ---- 1. greedy identity with prompt lookup ------------------------------------------------------------------------
@pytest.mark.parametrize("draft_len,buckets", [(1, ()), (2, ()), (3, ()), (4, ()), (7, ()), (7, (1, 2, 4, 7))])
def test_greedy_identity_ngram_continuous_batching(stdlib, prompts, reference, draft_len, buckets):
    """Ten prompts through max_batch 4 (requests join as others leave; every call mixes sequence lengths, draft
    lengths and, near each request's end, drafts capped by its max_new_tokens) emit plain greedy's tokens; with
    the default bucket (every call padded to draft_len) and with buckets 1, 2, 4, 7 (the pad follows the
    longest draft of the call)."""
    news = [MAX_NEW - 3 * (i % 5) for i in range(len(prompts))]
    eng = engine(stdlib, ngram(draft_len, buckets))
    got = run_requests(eng, prompts, news)
    for i, (g, r, n) in enumerate(zip(got, reference, news)):
        assert g == r[:n], f"prompt {i}: speculative {g} != plain {r[:n]}"
    st = eng.stats
    assert st["spec_calls"] > 0 and st["spec_accepted"] > 0          # speculation happened and paid
    assert st["spec_drafted"] > st["spec_accepted"]                  # and drafts were rejected
    assert st["verify_calls"] > 0
    assert st["generated_tokens"] == sum(news)
    assert not eng.seqs and not eng.ledger.budget
    eng.pool.check_empty()


def test_greedy_identity_generate_uniform_and_min_n_1(stdlib, prompts, reference):
    """Engine.generate (one max_new_tokens for all) with a 1-gram drafter (drafts nearly every step)."""
    eng = engine(stdlib, ngram(4, min_n=1))
    got = eng.generate(prompts[:6], 24)
    assert got == [r[:24] for r in reference[:6]]
    assert eng.stats["spec_drafted"] > eng.stats["spec_accepted"] > 0
    eng.pool.check_empty()


@pytest.mark.parametrize("draft_len", [3, 7])
def test_greedy_identity_with_stop_token(stdlib, prompts, reference, draft_len):
    """A stop token inside an accepted draft ends the request there (the stop token included, nothing after)."""
    counts = Counter(t for r in reference for t in r[1:])
    stop = next(t for t, _ in counts.most_common() if sum(t in r for r in reference) >= 3)
    expect = []
    for r in reference:
        cut = next((i + 1 for i, t in enumerate(r) if t == stop), len(r))
        expect.append(r[:cut])
    assert sum(len(e) < MAX_NEW for e in expect) >= 3
    eng = engine(stdlib, ngram(draft_len))
    got = eng.generate(prompts, MAX_NEW, stop_token_ids=[stop])
    assert got == expect
    assert eng.stats["spec_accepted"] > 0
    assert not eng.seqs
    eng.pool.check_empty()


def test_greedy_identity_small_max_new_tokens(stdlib, prompts, reference):
    """max_new_tokens 1, 2, 3: drafts are capped at max_new - generated - 1 (0 for 1 and 2), never past it."""
    news = [1 + i % 3 for i in range(len(prompts))]
    eng = engine(stdlib, ngram(4, min_n=1))
    got = run_requests(eng, prompts, news)
    assert got == [r[:n] for r, n in zip(reference, news)]
    assert eng.stats["spec_drafted"] <= sum(1 for n in news if n == 3)  # a draft of at most 1 where n is 3
    eng.pool.check_empty()


def test_greedy_identity_up_to_max_context(stdlib, prompts, reference):
    """Requests that run to the last position of max_context (draft length 7, pages of 16): drafts are capped by
    the context too, and a padded call that would pass it decodes plainly."""
    ctx = 56
    sel = [i for i, p in enumerate(prompts) if 16 <= len(p) <= 48]
    assert len(sel) >= 4
    news = [ctx - len(prompts[i]) for i in sel]
    eng = engine(stdlib, ngram(7, min_n=1), max_context=ctx, page_size=16)
    got = run_requests(eng, [prompts[i] for i in sel], news)
    assert got == [reference[i][:n] for i, n in zip(sel, news)]
    assert eng.stats["spec_drafted"] > eng.stats["spec_accepted"] > 0
    eng.pool.check_empty()


def test_ngram_drafter_and_accept_greedy_units():
    d = NgramDrafter(max_n=3, min_n=1)
    # the latest earlier occurrence of the longest matching tail wins
    assert d.propose([[1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]], [2]) == [[4, 5]]
    assert d.propose([[1, 2, 3, 4]], [3]) == [[]]
    assert d.propose([[7, 8, 7]], [0]) == [[]]
    assert d.propose([[5, 6, 5]], [4]) == [[6, 5]]          # the continuation may reach the tail itself
    with pytest.raises(ArgumentError):
        NgramDrafter(max_n=1, min_n=2)
    # a request's index, extended as its context grows (and rebuilt for a context it did not index), drafts what a
    # scan of the whole context finds
    import random

    def scan(ctx, k, max_n=4, min_n=2, ends_before=None):
        """The latest earlier occurrence of the tail's n-gram, among those ending before `ends_before` (the
        indexed length; default: the tail's own start)."""
        for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
            for s in range(min(len(ctx) - n - 1, (ends_before or len(ctx)) - n - 1), -1, -1):
                if ctx[s:s + n] == ctx[len(ctx) - n:]:
                    return ctx[s + n:s + n + k]
        return []

    rng, inc = random.Random(0), NgramDrafter(slack=0)
    for rid in range(40):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 10))]
        for _ in range(50):
            k = rng.randrange(0, 5)
            assert inc.propose_for([rid], [ctx], [k]) == [scan(ctx, k) if k else []]
            ctx = ctx + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        ctx = ctx[:5] + [9] * 3                  # not the context it indexed
        assert inc.propose_for([rid], [ctx], [2]) == [scan(ctx, 2)]
        inc.forget(rid)
    assert not inc._index
    # with slack, a lookup uses the index as it is while it lags by at most `slack` tokens (the engine indexes
    # while the device runs: NgramDrafter.index): a scan of the n-grams ending before the indexed length
    lag = NgramDrafter(slack=3)
    for rid in range(40):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(4, 10))]
        lag.index([rid], [ctx])
        for _ in range(50):
            ctx = ctx + [rng.randrange(6) for _ in range(rng.randrange(1, 3))]
            behind = lag._index[rid].length
            got = lag.propose_for([rid], [ctx], [3])[0]
            if len(ctx) - behind > 3:            # too far behind: extended first
                assert got == scan(ctx, 3) and lag._index[rid].length == len(ctx)
            else:
                assert got == scan(ctx, 3, ends_before=behind) and lag._index[rid].length == behind
            if rng.random() < 0.3:
                lag.index([rid], [ctx])
                assert lag.propose_for([rid], [ctx], [3]) == [scan(ctx, 3)]
    with pytest.raises(ArgumentError):
        NgramDrafter(slack=-1)
    assert accept_greedy([4, 5, 6], [4, 5]) == [4, 5, 6]
    assert accept_greedy([4, 9, 6], [4, 5]) == [4, 9]
    assert accept_greedy([3, 5, 6], [4, 5]) == [3]
    sp = Speculation(NgramDrafter(), draft_len=7, buckets=(1, 2, 4, 7))
    assert [sp.bucket(d) for d in range(1, 8)] == [1, 2, 4, 4, 7, 7, 7]
    default = Speculation(NgramDrafter(), draft_len=7)
    assert default.buckets[-1] == 7 and all(default.bucket(d) >= d for d in range(1, 8))
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ArgumentError):
            Speculation(NgramDrafter(), draft_len=bad)


def test_controller_turns_speculation_off_and_probes_less_and_less():
    """The adaptive controller (synthetic step times): verifies first, then decodes plainly until both costs are
    known (the first step of each kind and capture steps left out; the median of recent steps, so one slow step
    does not decide); keeps verifying while the requests' gains pay by the margin; otherwise probes after n, 2n,
    4n, ... plain steps (capped at 32n; n = (ratio - 1) / probe_cost: failed probes cost probe_cost of the plain
    time), at once at the cap when a verification costs more than draft_len + 1 plain steps; a paying probe resets the interval; another batch size uses the nearest one's cost ratio. Gains are
    per request (an unknown one counts as the mean)."""
    def drive(sp, steps, verify_s, tokens, plain_s=1.0, rids=tuple(range(8))):
        drafted = []
        for i in range(steps):
            w = sp.wanted(list(rids))
            drafted.append(w)
            sp.observe(list(rids), verify_s if w else plain_s, {r: tokens for r in rids} if w else None)
        return drafted

    sp = Speculation(NgramDrafter(), draft_len=4)
    sp.observe(list(range(8)), 50.0, {r: 5 for r in range(8)}, timed=False)   # a capture step: no time
    d = drive(sp, 8, verify_s=2.0, tokens=3.0)                   # pays: 1.5 tokens per plain-step time
    assert d[:3] == [True] * 3 and d[3:7] == [False] * 4 and all(d[7:]), d
    sp.observe(list(range(8)), 40.0, {r: 3 for r in range(8)})   # one slow step: the median holds
    assert sp.wanted(list(range(8)))
    n = sp.probe_interval(2.0)
    assert n == 20 and sp.probe_interval(1.01) == 1 and sp.probe_interval(6.0) == 100
    d = drive(sp, 7 * n + 3, verify_s=2.0, tokens=2.05)           # acceptance falls: 1.025x < 1 + margin
    probes = [i for i, x in enumerate(d) if x]
    assert [b - a for a, b in zip(probes[-3:], probes[-2:])] == [n, 2 * n], probes   # then 4n ...
    sp._gain.pop(7)                               # request 7 unknown: the mean of all (~2.05): not tried
    assert drive(sp, 1, verify_s=2.0, tokens=2.05) == [False]
    for _ in range(30):                                          # it pays again: every step drafts
        sp.observe(list(range(8)), 2.0, {r: 5 for r in range(8)})
    assert all(drive(sp, 10, verify_s=2.0, tokens=5.0))
    assert sp.ratio(5) == sp.ratio(8) == 2.0 and sp.cost(5, True) is None    # a smaller batch: 8's ratio, no
    assert all(drive(sp, 5, verify_s=2.0, tokens=5.0, rids=range(5)))        # relearning
    assert sp.ratio(3) is None and sp.ratio(17) is None                      # past a factor of two: its own,
    d = drive(sp, 10, verify_s=2.0, tokens=5.0, rids=range(20, 23))          # verifications first, then plain
    assert d[:4] == [True] * 4 and d[4:8] == [False] * 4 and all(d[8:]) and sp.ratio(3) == 2.0
    sp.forget(3)
    assert 3 not in sp._gain
    costly = Speculation(NgramDrafter(), draft_len=4)
    d = drive(costly, 4000, verify_s=6.0, tokens=4.0)            # 6 plain steps' time for at most 5 tokens
    assert d[:8] == [True] * 4 + [False] * 4 and sum(d[8:]) == 1 and d.index(True, 8) == 8 + 32 * 100 - 1
    assert not any(drive(costly, 100, verify_s=6.0, tokens=4.0, rids=range(5)))   # 8's ratio: off at once
    assert all(drive(Speculation(NgramDrafter(), draft_len=4, adaptive=False), 50, verify_s=9.0, tokens=1.0))
    mixed = Speculation(NgramDrafter(), draft_len=4)           # the lower quartile decides, not the mean
    mixed.observe(list(range(8)), 1.0, {r: 5 if r > 1 else 1 for r in range(8)})
    assert mixed.pays(list(range(8)), 2.0)                     # two of eight slowed: a quarter, still drafts
    for _ in range(6):
        mixed.observe(list(range(8)), 1.0, {2: 1})
    assert mixed.gain(list(range(8))) > 3.0 and not mixed.pays(list(range(8)), 2.0)   # three: the mean would


def test_drafts_in_hand_decide_a_verification():
    """A request's expected tokens a verification weigh its gain with a draft by how often its drafter finds one;
    a step verifies the drafts in hand only when three quarters of its rows would pay (a row without a draft at one
    token), and always while the cost ratio is unknown."""
    sp = Speculation(NgramDrafter(), draft_len=4)
    rids = list(range(8))
    assert sp.worth(rids, [0] * 8)                               # no cost ratio yet: verify (and learn it)
    for _ in range(4):                                           # the first of each kind is no sample
        sp.observe(rids, 2.0, {r: 4 for r in rids})
        sp.observe(rids, 1.0, None)
    assert sp.ratio(8) == 2.0 and sp.expected(0) == 4.0
    assert sp.worth(rids, [3] * 6 + [0] * 2)                     # two of eight without one: the quartile pays
    assert not sp.worth(rids, [3] * 5 + [0] * 3)                 # three: it does not
    for _ in range(10):
        sp.found(rids, [3] * 4 + [0] * 4)                        # half the rows rarely find a draft
    assert sp.expected(7) < 1.5 < 3.9 < sp.expected(0)
    assert not sp.pays(rids, 2.0) and sp.pays(rids[:4], 2.0)
    sp.forget(7)
    assert 7 not in sp._found and abs(sp.expected(7) - (sp._all_found * 4.0 + 1.0 - sp._all_found)) < 1e-9
    assert Speculation(NgramDrafter(), draft_len=4, adaptive=False).worth(rids, [0] * 8)


def test_shadow_drafts_score_plain_steps():
    """On plain steps a cheap drafter's drafts are scored against the tokens that follow (shadow drafting): up to
    shadow_rows requests a step, round robin, one pending draft each; a draft is decided by its first mismatch or
    once every drafted position is filled, and credits kept + 1 tokens to the request's gain, which turns
    verification back on once it pays. None for a draft model (not cheap) or without the adaptive controller."""
    class Seq:
        def __init__(self, tokens):
            self.tokens = tokens

    sp = Speculation(NgramDrafter(), draft_len=4, shadow_rows=2)
    assert sp.shadow_rids([1, 2, 3]) == [1, 2] and sp.shadow_rids([1, 2, 3]) == [3, 1]
    sp.shadow(1, 3, [7, 8, 9])
    sp.shadow(2, 3, [])                                # nothing drafted: nothing pending
    assert sorted(sp.shadow_rids([1, 2, 3])) == [2, 3]  # 1 has a pending draft
    seqs = {1: Seq([0, 0, 0, 7, 8])}
    sp.settle(seqs)                                    # 7, 8 match and 9 is not decided yet
    assert 1 in sp._shadow and 1 not in sp._gain
    seqs[1].tokens += [9]
    sp.settle(seqs)
    assert 1 not in sp._shadow and sp._gain[1] == 4    # all three kept, plus the target's own token
    sp.shadow(1, 6, [5, 5])
    seqs[1].tokens += [4, 5]
    sp.settle(seqs)
    assert sp._gain[1] == 0.7 * 4 + 0.3 * 1            # rejected at once: one token
    sp.shadow(2, 0, [1])
    sp.forget(2)
    assert 2 not in sp._shadow
    # gains raised by shadows turn drafting back on: costs known (verify = 2 plain steps), gain 1.2 -> off
    for _ in range(5):
        sp.observe([1], 1.0, None)
        sp.observe([1], 2.0, {1: 1})
    assert not sp.wanted([1])
    for _ in range(4):
        sp.shadow(1, len(seqs[1].tokens), [3, 3, 3, 3])
        seqs[1].tokens += [3] * 4
        sp.settle(seqs)
    assert sp._gain[1] > 2.1 and sp.wanted([1])
    assert Speculation(NgramDrafter(), draft_len=4, adaptive=False).shadow_rids([1]) == []

    class Costly(NgramDrafter):
        cheap = False
    assert Speculation(Costly(), draft_len=4).shadow_rids([1]) == []


# ---- 2. draft models ----------------------------------------------------------------------------------------------
def tiny_spec(vocab: int, layers: int = 2):
    """examples/k3-tiny.yaml cut to `layers` layers (one KDA then one MLA for 2) with the given vocabulary."""
    text = (ROOT / "examples" / "k3-tiny.yaml").read_text()
    pattern = "[kda, mla]" if layers == 2 else "[kda, kda, kda, mla]"
    for old, new in (("vocab_size: 256", f"vocab_size: {vocab}"), ("count: 8", f"count: {layers}"),
                     ("pattern: [kda, kda, kda, mla]", f"pattern: {pattern}"), ("block_size: 3", "block_size: 1")):
        assert old in text
        text = text.replace(old, new)
    spec = parse_spec_text(text, "tiny-draft.yaml")
    assert spec.layer_kinds == ("kda", "mla")[:layers] and spec.vocab_size == vocab
    return spec


@pytest.fixture(scope="module")
def random_draft():
    spec = tiny_spec(4096)
    return k3c.compile(spec, target="cpu"), k3c.init_weights(spec, seed=1)


@pytest.mark.parametrize("which", ["same", "random"])
def test_draft_model_drafter_greedy_identity(stdlib, prompts, reference, random_draft, which):
    """A draft model drafts: (same) the target model itself, whose drafts the target keeps (almost) always;
    (random) a 2-layer random model of the same vocabulary, nearly always wrong: rollbacks on every step. The
    target emits plain greedy's tokens, and both engines' pools are full again after the requests finished
    (Engine.finish -> DraftModelDrafter.forget -> the draft engine's sequence finishes)."""
    if which == "same":
        model, w = stdlib
    else:
        model, w = random_draft
    draft_eng = Engine(model, w, device="cpu", max_batch=4, max_context=CTX, use_kernels=False, cuda_graphs=False)
    drafter = DraftModelDrafter(draft_eng)
    eng = engine(stdlib, Speculation(drafter, draft_len=4, adaptive=False))
    sel = [0, 1, 3, 4, 6, 9]
    news = [MAX_NEW - 6 * (i % 3) for i in range(len(sel))] if which == "same" else [16] * len(sel)
    got = run_requests(eng, [prompts[i] for i in sel], news)
    assert got == [reference[i][:n] for i, n in zip(sel, news)]
    st = eng.stats
    assert st["spec_calls"] > 0
    if which == "same":
        assert st["spec_accepted"] >= 0.9 * st["spec_drafted"] > 0
    else:
        assert st["spec_drafted"] - st["spec_accepted"] >= 0.8 * st["spec_drafted"] > 0
    assert not drafter._seqs and not drafter._marks and not draft_eng.seqs
    eng.pool.check_empty()
    draft_eng.pool.check_empty()


def test_draft_model_drafter_needs_eager_engine(random_draft):
    model, w = random_draft
    with pytest.raises(ArgumentError, match="cuda_graphs=False"):
        DraftModelDrafter(Engine(model, w, device="cpu", max_context=64, use_kernels=False, cuda_graphs=True))


def test_draft_model_drafter_follows_rewinds(random_draft):
    """The draft engine's sequence follows its target's context: after drafting k tokens it holds the context and
    k - 1 drafts; a context that keeps only some of them rewinds it (its MLA pages released, its KDA states the
    ones kept at that length), and the drafts proposed then equal those of a fresh drafter."""
    model, w = random_draft
    mk = lambda: Engine(model, w, device="cpu", max_batch=2, max_context=128, page_size=4,  # noqa: E731
                        use_kernels=False, cuda_graphs=False)
    a = DraftModelDrafter(mk())
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 4096, (10,), generator=g).tolist()
    d1 = a.propose_for([7], [ctx], [5])[0]
    assert len(d1) == 5
    seq = a.engine.seqs[a._seqs[7]]
    assert seq.tokens == ctx + d1[:4] and seq.length == 14
    nxt = ctx + d1[:2] + [(d1[2] + 1) % 4096]          # two drafts kept, then the target's own token
    d2 = a.propose_for([7], [nxt], [3])[0]
    fresh = DraftModelDrafter(mk())
    assert d2 == fresh.propose_for([0], [nxt], [3])[0]
    seq = a.engine.seqs[a._seqs[7]]
    assert seq.tokens[:len(nxt)] == nxt and len(seq.pages) == a.engine.pool.pages_for(seq.length)
    a.forget(7)
    fresh.forget(0)
    a.engine.pool.check_empty()
    fresh.engine.pool.check_empty()


# ---- 3. rollback exactness ----------------------------------------------------------------------------------------
def fresh_prefix(stdlib, tokens, **kw):
    """A plain engine's opened sequence that consumed `tokens` in one extend: (engine, its SeqState)."""
    eng = engine(stdlib, **kw)
    rid = eng.open()
    eng.extend([rid], [tokens])
    return eng, eng.seqs[rid]


def test_rollback_state_equals_fresh_prefix(stdlib, prompts, reference):
    """Three sequences in one verification call, each keeping a different number of its drafts (0, 1, 3 of 5):
    after every step, each one's KDA states / conv tails and its MLA rows equal those of a fresh engine that
    extended just the kept tokens, and it holds exactly the pages of its length."""
    sel, goods = [1, 2, 8], [0, 1, 3]
    scripts = [(prompts[i], reference[i], gd) for i, gd in zip(sel, goods)]
    drafter = ScriptedDrafter(scripts, 4096)
    eng = engine(stdlib, Speculation(drafter, draft_len=5, adaptive=False), page_size=16)
    rids = [eng.add_request(prompts[i], MAX_NEW) for i in sel]     # no draft is capped in these 7 steps
    got = {r: [] for r in rids}
    checked = 0
    for step in range(7):
        before = dict(eng.stats)
        for o in eng.step():
            got[o.rid].append(o.token)
        if eng.stats["spec_calls"] == before.get("spec_calls", 0):
            continue                                  # the prefill step
        # every step after the prefill verified a draft of 5 for each and rejected one
        assert eng.stats["spec_calls"] - before.get("spec_calls", 0) == 3
        assert (eng.stats["spec_accepted"] - before.get("spec_accepted", 0)) == sum(goods)
        for rid, gd, i in zip(rids, goods, sel):
            seq = eng.seqs[rid]
            assert seq.length == len(seq.tokens) - 1          # the bonus token is pending
            assert len(seq.pages) == eng.pool.pages_for(seq.length)
            f_eng, f = fresh_prefix(stdlib, seq.tokens[:seq.length], page_size=16)
            for layer in eng.kda_layers:
                for a, b in zip(_states(seq.kda[layer]), _states(f.kda[layer])):
                    assert a.shape == b.shape
                    assert _rel_max(a, b) <= 1e-5, (step, rid, layer)
            ours, theirs = eng.pool.read_rows(seq.pages, seq.length), f_eng.pool.read_rows(f.pages, f.length)
            for layer in eng.mla_layers:
                assert _rel_max(ours[layer], theirs[layer]) <= 1e-5, (step, rid, layer)
            assert _rel_max(seq.last_logits, f.last_logits) <= 1e-5
            checked += 1
            if checked == 1:
                # negative control: the state had the rejected draft not been rolled back is far off
                wrong = seq.tokens[:seq.length] + [drafter.scripts[0][1][seq.length] + 1]
                _, w_seq = fresh_prefix(stdlib, wrong)
                assert max(_rel_max(a, b) for layer in eng.kda_layers
                           for a, b in zip(_states(seq.kda[layer]), _states(w_seq.kda[layer]))) > 1e-3
    assert checked == 18
    for r, i in zip(rids, sel):
        assert got[r] == reference[i][:len(got[r])]


def test_restore_against_token_by_token_kda(stdlib, prompts):
    """A traced 6-token call of two sequences (started from their prefilled states) keeps every token's KDA state:
    `restore` with keep counts (n_a, n_b) gives each row the state of the same sequences stepped one token at a
    time (plain decoding's T = 1 path) over its first n tokens, for equal and different counts, in place of the
    call's committed states; n = T leaves them as the call made them; counts outside [1, T] are refused."""
    from k3c.runtime.caches.kda_rollback import restore

    T = 6
    seg_a, seg_b = [11, 12, 13, 14, 15, 16], prompts[0][:T]
    for keeps in ((T, T), (3, 3), (1, 5), (6, 2)):
        eng, step = engine(stdlib), engine(stdlib)
        got_rows = []
        for e in (eng, step):
            a, b = e.open(), e.open()
            e.extend([a, b], [prompts[1], prompts[2]])
            got_rows.append((a, b))
        (a, b), (sa_, sb_) = got_rows
        sa, sb = eng.seqs[a], eng.seqs[b]
        eng.runner.run([(sa, seg_a), (sb, seg_b)], evict=True, trace={a, b})   # a traced (verification) call
        trace, row_a, _ = eng.runner.traces[a]
        assert eng.runner.traces[b][0] is trace and row_a == 0 and eng.runner.traces[b][1] == 1
        assert set(trace) == set(eng.kda_layers) and trace[eng.kda_layers[0]].states.shape[:2] == (T, 2)
        for r, seg, n in ((sa_, seg_a, keeps[0]), (sb_, seg_b, keeps[1])):
            for tok in seg[:n]:
                step.extend([r], [[tok]])
        restore(trace, {i: sa.kda[i][0] for i in eng.kda_layers}, list(keeps))
        for seq, r in ((sa, sa_), (sb, sb_)):
            for layer in eng.kda_layers:
                for x, y in zip(_states(seq.kda[layer]), _states(step.seqs[r].kda[layer])):
                    assert _rel_max(x, y) <= 1e-5, (keeps, layer)
        for bad in ([0, T], [T + 1, 1], [1]):
            with pytest.raises(ValueError):
                restore(trace, {i: sa.kda[i][0] for i in eng.kda_layers}, bad)


def test_captured_restore_equals_eager_restore():
    """CapturedRestore (one capture through the graph backend, then a keep-count copy and a replay a rollback) gives
    every layer's slots, state and conv tails, exactly what the eager `restore` gives, over successive rollbacks
    with different keep counts (the replay reads the new counts); all counts = T changes nothing; bad counts are
    refused."""
    from k3c.runtime.cuda_graph import EagerBackend
    from k3c.reference.kda import KDAState
    from k3c.runtime.caches.kda_rollback import CapturedRestore, KDATokens, restore

    g = torch.Generator().manual_seed(0)
    T, B = 4, 3

    def state():
        return KDAState(torch.randn(B, 2, 4, 5, generator=g), tuple(torch.randn(B, 6, 3, generator=g) for _ in range(3)))

    layers = (1, 3)
    trace = {i: KDATokens.like(state(), T) for i in layers}
    for t in trace.values():
        for x in (t.states, *t.conv):
            x.copy_(torch.randn(x.shape, generator=g))
    slots = {i: state() for i in layers}
    backend = EagerBackend()
    cap = CapturedRestore(backend, trace, slots)
    for keeps in ([2, 4, 1], [4, 4, 4], [1, 1, 3], [3, 2, 4]):
        want = {i: KDAState(s.state.clone(), tuple(c.clone() for c in s.conv)) for i, s in slots.items()}
        restore(trace, want, list(keeps))
        cap(list(keeps))
        for i in layers:
            for x, y in zip((slots[i].state, *slots[i].conv), (want[i].state, *want[i].conv)):
                assert torch.equal(x, y), (keeps, i)
    assert backend.captures == 1 and backend.replays == 3
    for bad in ([0, 1, 1], [1, 5, 1], [1, 1]):
        with pytest.raises(ValueError):
            cap(bad)


# ---- 4. the page pool ---------------------------------------------------------------------------------------------
def test_page_pool_tight_pool_rejected_drafts(stdlib, prompts, reference):
    """A pool of 14 pages of 16 rows, draft length 7 (padded calls cross page boundaries and are mostly
    rejected): after every step each running sequence holds pages_for(its length) pages, the free count is the
    rest, each request's admission reserve is its worst case minus what it holds (never negative), and requests
    are admitted exactly when plain decoding's reserve rule admits them; at the end every page is back."""
    sel = [0, 1, 2, 3, 6, 8, 9]
    news = [28, 20, 24, 28, 16, 24, 20]
    eng = engine(stdlib, ngram(7, min_n=1), page_size=16, num_pages=14)
    pool = eng.pool
    released = []
    orig = eng.ledger.rewind

    def counting(seq, n):
        before = len(seq.pages)
        orig(seq, n)
        released.append(before - len(seq.pages))
    eng.ledger.rewind = counting
    rids = [eng.add_request(prompts[i], n) for i, n in zip(sel, news)]
    worst = {r: pool.pages_for(len(prompts[i]) + n) for r, i, n in zip(rids, sel, news)}
    got = {r: [] for r in rids}
    waits = 0
    for _ in range(200):
        if not eng.has_work():
            break
        # plain decoding's reserve rule: the head of the queue is admitted while the pool holds its worst case on
        # top of what running requests may still claim (that sum is independent of their lengths)
        free = pool.num_free - sum(max(0, b) for b in eng.ledger.budget.values())
        running, expect = len(eng.running), []
        for s in eng.waiting:
            if running >= eng.max_batch or free < worst[s.rid]:
                break
            expect.append(s.rid)
            free -= worst[s.rid]
            running += 1
        waiting_before = [s.rid for s in eng.waiting]
        waits += len(waiting_before) > len(expect)
        for o in eng.step():
            got[o.rid].append(o.token)
        admitted = [r for r in waiting_before if r not in {s.rid for s in eng.waiting}]
        assert admitted == expect
        held = 0
        for seq in eng.running:
            assert len(seq.pages) == pool.pages_for(seq.length)
            assert eng.ledger.budget[seq.rid] == worst[seq.rid] - len(seq.pages) >= 0
            held += len(seq.pages)
        assert pool.num_free == pool.num_pages - held
        assert all(b >= 0 for b in eng.ledger.budget.values())
    assert not eng.has_work()
    assert waits > 0                                       # the pool, not max_batch, held requests back
    assert [got[r] for r in rids] == [reference[i][:n] for i, n in zip(sel, news)]
    st = eng.stats
    assert st["spec_drafted"] - st["spec_accepted"] >= 30
    assert sum(released) >= 5                              # rejections gave whole pages back
    assert not eng.ledger.budget
    pool.check_empty()


# ---- 5. sampling --------------------------------------------------------------------------------------------------
def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(Pearson statistic, degrees of freedom) of token counts against a distribution; bins of expected count
    below 5 are merged; a token of probability 0 emitted makes it infinite."""
    n = int(counts.sum())
    assert n > 500
    if int(counts[probs == 0].sum()):
        return math.inf, 1
    exp = probs.double() * n
    keep = exp >= 5
    obs_b = counts[keep].double().tolist()
    exp_b = exp[keep].tolist()
    rest_o, rest_e = float(counts[~keep & (probs > 0)].sum()), float(exp[~keep].sum())
    if rest_e > 0:
        obs_b.append(rest_o)
        exp_b.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    return stat, len(obs_b) - 1


def _bound(df: int, alpha: float = 1e-4) -> float:
    try:
        from scipy.stats import chi2
        return float(chi2.ppf(1 - alpha, df))
    except ImportError:        # Wilson-Hilferty: upper quantile (z = 3.719 for 1e-4)
        z = 3.719
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _emitted(rule, logits, drafts, params, n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [rule(logits, drafts, params, gen) for _ in range(n)]


def _check_distribution(runs, logits, drafts, params, vocab):
    """Chi-square statistics over bound: the first emitted token against row 0's distribution, and the token after
    i accepted drafts against row i's, for each i (conditioned on those drafts being accepted). Returns the worst
    statistic / bound."""
    p = filtered_probs(logits.float(), params)
    worst = 0.0
    for i in range(len(drafts) + 1):
        picked = [r[i] for r in runs if r[:i] == drafts[:i] and len(r) > i]
        if i and p[i - 1, drafts[i - 1]] == 0:     # a draft of probability 0 is never kept
            if picked:
                return math.inf
            continue
        counts = torch.bincount(torch.tensor(picked, dtype=torch.long), minlength=vocab)
        stat, df = _chi2(counts, p[i])
        worst = max(worst, stat / _bound(df))
    return worst


def _always_accept(logits, drafts, params, gen):
    """A wrong rule: every draft kept, then the bonus drawn from the last row."""
    p = _probs(logits, params)
    return list(drafts) + [int(torch.multinomial(p[len(drafts)], 1, generator=gen))]


def _resample_from_p(logits, drafts, params, gen):
    """A wrong rule: the draft kept with probability p(d), but a rejection draws from p itself (not the residual
    with d removed), which over-weights d."""
    p = _probs(logits, params)
    out = []
    for i, d in enumerate(drafts):
        if torch.rand(1, generator=gen).item() < float(p[i, d]):
            out.append(d)
            continue
        out.append(int(torch.multinomial(p[i], 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=gen)))
    return out


_PROBS: dict = {}


def _probs(logits, params):
    """filtered_probs of every row, computed once per (logits, params) (the wrong rules are cheap to draw)."""
    key = (id(logits), params)
    if key not in _PROBS:
        _PROBS.clear()
        _PROBS[key] = (logits, filtered_probs(logits.float(), params))
    return _PROBS[key][1]


N_DRAWS = 20000


@pytest.fixture(scope="module")
def model_logits(stdlib, prompts):
    """The example model's logits after the last 3 tokens of a prompt: rows for a draft of 2."""
    eng = engine(stdlib)
    rid = eng.open()
    return eng.extend([rid], [prompts[1]])[0][-3:].detach().clone()


def test_accept_sampled_preserves_distribution_random_logits():
    """V = 8, temperature 1, drafts [d0, d1] with d0 the second most likely token of row 0 (kept ~1/4 of the
    time) and d1 row 1's most likely: the first token ~ p0, the second given d0 kept ~ p1, the third given both
    kept ~ p2 (the bonus). The two wrong rules fail the same test by far."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 8, generator=g) * 1.5
    params = SamplingParams(temperature=1.0, seed=1)
    p = filtered_probs(logits, params)
    d0 = int(p[0].argsort(descending=True)[1])
    d1 = int(p[1].argmax())
    assert 0.1 < float(p[0, d0]) < 0.6
    drafts = [d0, d1]
    runs = _emitted(accept_sampled, logits, drafts, params, N_DRAWS, seed=11)
    assert 1 <= min(map(len, runs)) and max(map(len, runs)) == 3
    assert _check_distribution(runs, logits, drafts, params, 8) < 1.0
    # the acceptance rate itself: p0(d0)
    kept = sum(r[0] == d0 for r in runs) / N_DRAWS
    assert abs(kept - float(p[0, d0])) < 4 * math.sqrt(float(p[0, d0]) * (1 - float(p[0, d0])) / N_DRAWS)
    for wrong in (_always_accept, _resample_from_p):
        bad = _emitted(wrong, logits, drafts, params, N_DRAWS, seed=11)
        assert _check_distribution(bad, logits, drafts, params, 8) > 10.0, wrong.__name__


@pytest.mark.parametrize("case", ["filtered-in", "filtered-out"])
def test_accept_sampled_preserves_distribution_top_k_top_p(case):
    """Temperature 0.7, top_k 5, top_p 0.9 on V = 8: a draft inside the kept set, and one outside it (probability
    0: always rejected, never emitted)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 8, generator=g) * 2
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2)
    p = filtered_probs(logits, params)
    order = p[0].argsort(descending=True)
    d = int(order[1]) if case == "filtered-in" else int(order[-1])
    assert (float(p[0, d]) > 0.1) if case == "filtered-in" else float(p[0, d]) == 0.0
    assert int((p[0] > 0).sum()) < 8                      # the filters removed tokens
    runs = _emitted(accept_sampled, logits, [d], params, N_DRAWS, seed=3)
    assert _check_distribution(runs, logits, [d], params, 8) < 1.0
    if case == "filtered-out":
        assert all(len(r) == 1 and r[0] != d for r in runs)
    bad = _emitted(_always_accept, logits, [d], params, N_DRAWS, seed=3)
    assert _check_distribution(bad, logits, [d], params, 8) > 10.0


def test_accept_sampled_preserves_distribution_model_logits(model_logits):
    """The example model's real logits (V = 4096), temperature 1 with top_k 6 / top_p 0.95 (10000 draws: each
    sorts 3 x 4096 logits)."""
    params = SamplingParams(temperature=1.0, top_k=6, top_p=0.95, seed=4)
    p = filtered_probs(model_logits, params)
    order = p[0].argsort(descending=True)
    d0 = int(order[1]) if float(p[0, order[1]]) > 0.05 else int(order[0])
    d1 = int(p[1].argmax())
    runs = _emitted(accept_sampled, model_logits, [d0, d1], params, N_DRAWS // 2, seed=9)
    assert _check_distribution(runs, model_logits, [d0, d1], params, 4096) < 1.0
    bad = _emitted(_resample_from_p, model_logits, [d0, d1], params, N_DRAWS // 2, seed=9)
    if float(p[0, d0]) < 0.9:
        assert _check_distribution(bad, model_logits, [d0, d1], params, 4096) > 10.0


def test_accept_sampled_point_mass():
    """A one-token distribution (greedy-like top_k 1): its draft is always kept, anything else never emitted."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    params = SamplingParams(temperature=1.0, top_k=1, seed=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert accept_sampled(logits, [1], params, gen) == [1, 0]
        assert accept_sampled(logits, [2], params, gen) == [1]


def test_greedy_rows_exact_beside_sampled_rows(stdlib, prompts, reference):
    """Greedy and sampled requests verify in the same calls: the greedy ones still emit plain greedy's tokens;
    the sampled ones run to their length, and the same seeds give the same tokens again."""
    sampling = [None if i % 2 == 0 else SamplingParams(temperature=1.0, top_k=20, seed=100 + i)
                for i in range(8)]

    def once():
        eng = engine(stdlib, ngram(4, min_n=1))
        got = eng.generate(prompts[:8], 24, sampling=sampling)
        assert eng.stats["spec_accepted"] > 0
        eng.pool.check_empty()
        return got
    got = once()
    for i, g in enumerate(got):
        assert len(g) == 24
        if sampling[i] is None:
            assert g == reference[i][:24], i
    assert got[1::2] != [reference[i][:24] for i in range(1, 8, 2)]      # sampled rows did sample
    assert once() == got


# ---- 6. verification through (stand-in) CUDA graphs ----------------------------------------------------------------
@pytest.mark.slow
def test_verification_graph_greedy_identity(one_thread):
    """Kernels on (Triton interpreter) with EagerBackend: verification calls of (batch, 1 + draft) tokens run
    through a DecodeGraph(tokens=T) from their second call in a row; drafts are half rejected, so the KDA rollback
    restores from the graph's per-token buffers (views of the engine's shared ones), through the graph's captured
    restore. Tokens equal the plain kernel engine's; logits within 1e-5; every page back."""
    from k3c.runtime.cuda_graph import EagerBackend

    spec = tiny_spec(256)
    model, w = k3c.compile(spec, target="h200"), k3c.init_weights(spec, seed=0)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    kw = dict(device="cpu", max_batch=2, max_context=64, page_size=8, use_kernels=True)
    plain = Engine(model, w, **kw)
    outs = {}
    rids = [plain.add_request(p, 9) for p in prompts]
    while plain.has_work():
        for o in plain.step():
            outs.setdefault(o.rid, []).append(o)
    ref = [outs[r] for r in rids]
    scripts = [(p, [o.token for o in r], 1) for p, r in zip(prompts, ref)]
    # max_batch 3: the verification graph of 2 writes the first 2 rows of the engine's shared per-token buffers
    eng = Engine(model, w, **{**kw, "max_batch": 3}, graph_backend=EagerBackend(),
                 speculation=Speculation(ScriptedDrafter(scripts, 256), draft_len=2, adaptive=False))
    got = {}
    rids = [eng.add_request(p, 9) for p in prompts]
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.rid, []).append(o)
    for a, b in zip([got[r] for r in rids], ref):
        assert [o.token for o in a] == [o.token for o in b]
        for x, y in zip(a, b):
            assert _rel_max(x.logits, y.logits) <= 1e-5
    st = eng.stats
    assert st["verify_graph_calls"] > 0
    assert st["spec_drafted"] > st["spec_accepted"] > 0
    assert all(dg.report.mode == "graph" for dg in eng.graph_pool.graphs.values())
    assert any(dg.tokens == 3 for dg in eng.graph_pool.graphs.values())
    assert eng.graph_pool.kda_tokens[3][eng.kda_layers[0]].states.shape[:2] == (3, 3)
    # rollbacks inside a graph's slots ran through its captured restore (kda_rollback.CapturedRestore)
    assert any(dg._restore is not None and dg._restore._replay is not None for dg in eng.graph_pool.graphs.values())
    assert all(dg.kda_tokens[i].states.shape[:2] == (3, dg.batch) for dg in eng.graph_pool.graphs.values() if dg.tokens == 3
               for i in eng.kda_layers)
    eng.pool.check_empty()
    plain.pool.check_empty()
