"""Prefix cache: a request resumed from a checkpoint gives the logits of a cold run; MLA pages are shared by
reference count (copied before a second writer appends into a shared page); LRU eviction under a byte budget with
offload to host and disk; every page returns to the pool."""
import os

import pytest
import torch

import k3c
from k3c.errors import ArgumentError
from k3c.runtime.prefix_cache import PrefixCache
from numerics import rel
from prefix_helpers import engine, serve, toks

TINY = "examples/k3-tiny.yaml"


def test_resumed_requests_match_cold_runs(tiny, one_thread):
    spec, model, w = tiny
    pc = PrefixCache(interval=16)
    eng = engine(tiny, pc)
    base = toks(spec, 43, 1)
    a, outs_a = serve(eng, base, 5)                            # checkpoints at 16, 32, 43 (prompt end), 47 (finish)
    assert sorted(c.length for c in pc.entries.values()) == [16, 32, 43, 47]
    cold = engine(tiny)
    cases = [(base[:37] + toks(spec, 9, 2), 32),               # shares 37 tokens: resumes at 32, recomputes the rest
             (base + toks(spec, 4, 3), 43),                    # the prompt-end checkpoint; its last page is shared
             (base + [o.token for o in outs_a][:4] + toks(spec, 3, 4), 47),   # the finish checkpoint (next turn)
             (list(base), 43)]                                 # the same prompt again: no compute before token 1
    for prompt, depth in cases:
        calls = eng.stats["prefill_calls"]
        seq, outs = serve(eng, prompt, 4)
        assert seq.resumed == depth
        _, ref_outs = serve(cold, prompt, 4)
        assert [o.token for o in outs] == [o.token for o in ref_outs]
        # fp32, another chunking of the same tokens: 1.1e-5 where the CPU's reductions run in AVX-512 order
        assert rel(torch.stack([o.logits for o in outs]), torch.stack([o.logits for o in ref_outs])) <= 2e-5
        if depth == len(prompt):
            assert eng.stats["prefill_calls"] == calls
    assert pc.stats["hits"] == 4 and pc.hit_rate() > 0.5
    pc.clear()
    eng.pool.check_empty()                                     # refcounts back to zero


def test_shared_pages_and_copy_on_write(tiny, one_thread):
    spec, model, w = tiny
    pc = PrefixCache(interval=1024)
    eng = engine(tiny, pc)
    base = toks(spec, 21, 5)                                   # pages of 8: the prompt end is inside page 2
    a = eng.open()
    eng.extend([a], [base])                                    # prompt-end checkpoint at 21: holds pages 0..2
    pages_a = list(eng.seqs[a].pages)
    assert [eng.pool.ref[p] for p in pages_a] == [2, 2, 2]
    eng.extend([a], [toks(spec, 2, 6)])                        # a appends in place past the checkpoint
    assert eng.seqs[a].pages == pages_a
    r = eng.add_request(base + toks(spec, 3, 7), 2)            # resumes at 21; must copy page 2 before writing
    eng.step()
    pages_b = eng.seqs[r].pages
    assert pages_b[:2] == pages_a[:2] and pages_b[2] != pages_a[2]
    assert eng.seqs[r].resumed == 21
    # held by a, b and the checkpoints at 21 and 23 (a's segment ends) and 24 (b's prompt end)
    assert [eng.pool.ref[p] for p in pages_a[:2]] == [5, 5]
    # a's own rows were not touched by b: a's next token still matches the reference
    nxt = toks(spec, 1, 8)
    got = eng.extend([a], [nxt])[0]
    ref = k3c.reference_forward(spec, w, torch.tensor([base + toks(spec, 2, 6) + nxt]))[0]
    assert rel(got[-1], ref[-1]) <= 1e-5
    eng.run()
    eng.finish(a)
    pc.clear()
    eng.pool.check_empty()


def test_lru_eviction_and_offload(tiny, one_thread, tmp_path):
    spec, model, w = tiny
    probe = PrefixCache(interval=1024)
    eng = engine(tiny, probe)
    serve(eng, toks(spec, 20, 9), 1)
    one = probe.tier_bytes("device")                           # bytes of the two checkpoints of one request
    probe.clear()
    # device budget for about one request; host for one more; the rest goes to disk
    pc = PrefixCache(interval=1024, max_bytes=one, host_bytes=one, disk=True, disk_dir=str(tmp_path), policy="lru")
    eng = engine(tiny, pc)
    prompts = [toks(spec, 20, 10 + i) for i in range(3)]
    for p in prompts:
        serve(eng, p, 1)
    assert pc.tier_bytes("device") <= one and pc.tier_bytes("host") <= one
    tiers = pc.tiers()
    assert tiers["device"] >= 1 and tiers["host"] >= 1 and tiers["disk"] >= 1
    # a file per disk checkpoint (its states) and per page it holds (no page shared here: unrelated prompts)
    assert len(os.listdir(tmp_path)) == tiers["disk"] + pc.disk_tier.pages == tiers["disk"] * 4
    assert pc.entries[next(iter(pc.entries))].tier == "disk"  # the least recently used went furthest
    cold = engine(tiny)
    for p in prompts:                                          # every tier resumes to the cold run's logits
        prompt = p + toks(spec, 3, 20)
        seq, outs = serve(eng, prompt, 4)
        assert seq.resumed == 20
        _, ref_outs = serve(cold, prompt, 4)
        assert rel(torch.stack([o.logits for o in outs]), torch.stack([o.logits for o in ref_outs])) <= 1e-5
    # a budget of zero bytes and no offload: everything is dropped, the pages come back
    drop = PrefixCache(interval=1024, max_bytes=0)
    eng2 = engine(tiny, drop)
    serve(eng2, prompts[0], 2)
    assert not drop.entries and drop.stats["evicted"] == 2
    eng2.pool.check_empty()
    pc.clear()
    assert os.listdir(tmp_path) == []
    eng.pool.check_empty()


def test_engine_evicts_checkpoints_for_pages(tiny, one_thread):
    spec, model, w = tiny
    pc = PrefixCache(interval=1024)
    eng = engine(tiny, pc, num_pages=6)
    serve(eng, toks(spec, 30, 30), 2)                          # 4 pages held by its checkpoints afterwards
    assert eng.pool.num_free == 2
    seq, outs = serve(eng, toks(spec, 30, 31), 2)              # needs 4: the old checkpoints make room
    assert len(outs) == 2 and pc.stats["evicted"] >= 1
    pc.clear()
    eng.pool.check_empty()


def test_bad_settings():
    with pytest.raises(ArgumentError, match="interval must be a positive integer"):
        PrefixCache(interval=0)
    with pytest.raises(ArgumentError, match="max_bytes must be a non-negative integer"):
        PrefixCache(max_bytes=-1)
