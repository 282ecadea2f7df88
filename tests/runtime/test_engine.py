"""Serving engine: continuous batching over a paged MLA cache equals the reference and running each request alone;
running out of pages fails before any state changes; the MLA mode that ran is exposed."""
import pytest
import torch

import k3c
from k3c.errors import ArgumentError
from k3c.runtime.caches.block_pool import CacheFullError
from k3c.runtime.engine import Engine
from numerics import rel

TINY = "examples/k3-tiny.yaml"


def engine(tiny, **kw):
    spec, model, w = tiny
    kw.setdefault("max_context", 64)
    kw.setdefault("page_size", 8)
    return Engine(model, w, use_kernels=False, **kw)


def prompts(spec, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths]


def check_against_reference(spec, w, prompt, outs):
    """Every sampled token's logits against one reference prefill of prompt + generated (teacher forced)."""
    toks = prompt + [o.token for o in outs]
    ref = k3c.reference_forward(spec, w, torch.tensor([toks]))[0]
    got = torch.stack([o.logits for o in outs])
    assert rel(got, ref[len(prompt) - 1:len(toks) - 1]) <= 1e-5
    assert [o.token for o in outs] == got.argmax(-1).tolist()


def test_continuous_batching_matches_reference_and_alone(tiny, one_thread):
    spec, model, w = tiny
    ps = prompts(spec, (11, 19, 6), seed=1)
    news = (7, 4, 6)
    eng = engine(tiny, max_batch=3)
    joins = {0: [0], 2: [1], 5: [2]}            # request index -> joins before that step
    rids, outs = {}, {}
    for step in range(40):
        for i in joins.get(step, []):
            rids[i] = eng.add_request(ps[i], news[i])
        for o in eng.step():
            outs.setdefault(o.rid, []).append(o)
        if step > 5 and not eng.has_work():
            break
    assert not eng.has_work()
    assert eng.stats["decode_calls"] < sum(news)          # decodes of different requests shared calls
    for i, p in enumerate(ps):
        got = outs[rids[i]]
        assert len(got) == news[i] and got[-1].finished
        check_against_reference(spec, w, p, got)
        alone = engine(tiny, max_batch=1)
        r = alone.add_request(p, news[i])
        solo = []
        while alone.has_work():
            solo += alone.step()
        assert [o.token for o in solo] == [o.token for o in got]
        assert rel(torch.stack([o.logits for o in got]), torch.stack([o.logits for o in solo])) <= 1e-5
        assert r == 0
    eng.pool.check_empty()                                 # every page returned


def test_extend_mixed_lengths_in_one_call(tiny, one_thread):
    spec, model, w = tiny
    eng = engine(tiny, max_batch=4)
    a, b = eng.open(), eng.open()
    pa, pb = prompts(spec, (13, 5), seed=2)
    la, lb = eng.extend([a, b], [pa[:9], pb])              # two groups (9 and 5 tokens)
    sa, sb = prompts(spec, (4, 4), seed=3)
    la2, lb2 = eng.extend([a, b], [sa, sb])                # one call: cached lengths 9 and 5, pages of size 8
    ref_a = k3c.reference_forward(spec, w, torch.tensor([pa[:9] + sa]))[0]
    ref_b = k3c.reference_forward(spec, w, torch.tensor([pb + sb]))[0]
    assert rel(torch.cat([la, la2]), ref_a) <= 1e-5
    assert rel(torch.cat([lb, lb2]), ref_b) <= 1e-5
    assert eng.seqs[a].length == 13 and len(eng.seqs[a].pages) == 2
    eng.finish(a)
    eng.finish(b)
    eng.pool.check_empty()


def test_out_of_pages_raises_before_any_state_changes(tiny, one_thread):
    spec, model, w = tiny
    eng = engine(tiny, num_pages=4, max_batch=4)
    a, b = eng.open(), eng.open()
    pa, pb = prompts(spec, (10, 7), seed=4)
    eng.extend([a, b], [pa, pb])                           # 2 + 1 pages: 1 left
    before = {r: (list(eng.seqs[r].pages), eng.seqs[r].length, dict(eng.seqs[r].kda)) for r in (a, b)}
    free = eng.pool.num_free
    with pytest.raises(CacheFullError, match="MLA cache full: this call needs up to 2 pages, 1 of 4 are free"):
        eng.extend([a, b], [prompts(spec, (7,), 5)[0], prompts(spec, (2,), 6)[0]])
    after = {r: (list(eng.seqs[r].pages), eng.seqs[r].length, dict(eng.seqs[r].kda)) for r in (a, b)}
    assert after == before and eng.pool.num_free == free
    # the sequences carry on as if the failed call never happened
    nxt = prompts(spec, (3,), 7)[0]
    got = eng.extend([a], [nxt])[0]
    ref = k3c.reference_forward(spec, w, torch.tensor([pa + nxt]))[0]
    assert rel(got, ref[10:]) <= 1e-5
    # a request that can never fit is refused when it is added; one that must wait is admitted later
    with pytest.raises(CacheFullError, match="needs 5 MLA pages, the pool has 4"):
        eng.add_request(prompts(spec, (30,), 8)[0], 6)
    # a request that cannot be admitted while opened sequences hold the pages: the step fails, nothing changes
    r0 = eng.add_request(prompts(spec, (20,), 12)[0], 4)
    free = eng.pool.num_free
    with pytest.raises(CacheFullError, match=f"request {r0} needs 3 pages, 1 of 4 are free"):
        eng.step()
    assert list(eng.waiting) == [eng.seqs[r0]] and eng.pool.num_free == free and eng.seqs[r0].length == 0
    eng.finish(r0)
    eng.finish(a)
    eng.finish(b)
    r1 = eng.add_request(prompts(spec, (20,), 9)[0], 4)        # 3 pages each: the second waits for the first
    r2 = eng.add_request(prompts(spec, (20,), 10)[0], 4)
    eng.step()
    assert [s.rid for s in eng.running] == [r1] and len(eng.waiting) == 1
    got = eng.run()
    assert len(got[r1]) == 3 and len(got[r2]) == 4            # r1's first token came from the step above
    eng.pool.check_empty()


def test_mode_exposed_per_call(tiny, one_thread):
    from k3c.analysis.cost import mla_mode_costs
    from k3c.runtime.devices import target_for

    spec, model, w = tiny
    eng = engine(tiny, max_context=256, page_size=16)
    s = eng.open()
    attrs = {op.attr("layer"): dict(op.attrs) for op in model.module.ops if op.op == "mla_absorbed"}
    mla_layers = sorted(attrs)
    for seg, cached in ((60, 0), (1, 60), (40, 61)):
        eng.extend([s], [prompts(spec, (seg,), seg)[0]])
        want = {i: mla_mode_costs(attrs[i], seg, cached, target_for("cpu"), batch=1).best for i in mla_layers}
        assert eng.last_modes == want
        if seg == 1:
            assert set(eng.last_modes.values()) == {"mqa"}         # decode: absorbed
    assert {m for (_, m) in eng.mode_counts} == {"mha", "mqa"}      # the fresh prefill ran MHA


def test_bad_arguments(tiny):
    spec, model, w = tiny
    eng = engine(tiny)
    with pytest.raises(ArgumentError, match="token ids must be in"):
        eng.add_request([0, spec.vocab_size])
    with pytest.raises(ArgumentError, match="exceeds max_context 64"):
        eng.add_request([1] * 60, max_new_tokens=8)
    with pytest.raises(ArgumentError, match="max_new_tokens must be a positive integer"):
        eng.add_request([1], max_new_tokens=0)
    with pytest.raises(ArgumentError, match="no opened sequence with id 7"):
        eng.extend([7], [[1]])
    with pytest.raises(ArgumentError, match="num_pages must be a positive integer"):
        engine(tiny, num_pages=0)


def test_adopt_a_given_cache(tiny, one_thread):
    """A sequence built from a reference cache (a migrated context) continues exactly like the reference."""
    from k3c.reference import ReferenceModel

    spec, model, w = tiny
    p, nxt = prompts(spec, (19, 4), seed=11)
    ref = ReferenceModel(spec, w)
    _, cache = ref.prefill(torch.tensor([p]))
    kda = {i: c for i, c in enumerate(cache.layers) if spec.layer_kinds[i] == "kda"}
    latent = {i: c[0] for i, c in enumerate(cache.layers) if spec.layer_kinds[i] == "mla"}
    eng = engine(tiny)
    rid = eng.adopt(p, kda, latent)
    got = eng.extend([rid], [nxt])[0]
    want = k3c.reference_forward(spec, w, torch.tensor([p + nxt]))[0, 19:]
    assert rel(got, want) <= 1e-5
    with pytest.raises(ArgumentError, match="layer 3 latent has shape"):
        eng.adopt(p, kda, {i: t[:5] for i, t in latent.items()})


def test_mixed_batch_mode_from_all_sequences(tiny, one_thread):
    """A call of sequences with different cached lengths takes its MLA mode from the cost model over all of them
    (batch_mla_mode), not from the first sequence: the same mode in either order, the same logits as the reference."""
    from k3c.analysis.cost import mla_mode_costs
    from k3c.runtime.devices import target_for
    from k3c.runtime.engine import batch_mla_mode
    from k3c.runtime.session import load_graph

    spec, model, w = tiny
    tgt = target_for("cpu")
    attrs = next(dict(op.attr_dict) for op in model.module.ops if op.op == "mla_absorbed")
    new, cached = 4, (0, 40)
    # alone, the fresh sequence would take MHA and the long one MQA; over both, the cost model says MQA
    assert mla_mode_costs(attrs, new, 0, tgt, batch=2).best == "mha"
    assert mla_mode_costs(attrs, new, 40, tgt, batch=2).best == "mqa"
    assert batch_mla_mode(attrs, new, list(cached), tgt) == "mqa"
    assert batch_mla_mode(attrs, new, [40, 0], tgt) == "mqa"
    assert batch_mla_mode(attrs, 60, [0, 40], tgt) == "mha"           # a long append: MHA over both
    assert batch_mla_mode(attrs, new, [40, 40], tgt) == mla_mode_costs(attrs, new, 40, tgt, batch=2).best
    long_p, seg_a, seg_b = prompts(spec, (40, new, new), seed=21)
    shared = load_graph(model, w, torch.device("cpu"), False)         # a graph built outside the engine too
    for order, graph in (((0, 1), None), ((1, 0), None), ((0, 1), shared)):
        eng = engine(tiny, max_batch=2, max_context=64, graph=graph)
        fresh, long = eng.open(), eng.open()
        eng.extend([long], [long_p])
        rids = [(fresh, long)[i] for i in order]
        segs = [(seg_a, seg_b)[i] for i in order]
        out = dict(zip(rids, eng.extend(rids, segs)))
        assert eng.stats["prefill_calls"] == 2                         # one call for both segments
        assert set(eng.last_modes.values()) == {"mqa"}
        assert rel(out[fresh], k3c.reference_forward(spec, w, torch.tensor([seg_a]))[0]) <= 1e-5
        assert rel(out[long], k3c.reference_forward(spec, w, torch.tensor([long_p + seg_b]))[0, 40:]) <= 1e-5
        eng.finish(fresh)
        eng.finish(long)
        eng.pool.check_empty()
