"""Optimistic admission: more requests run than their worst cases fit; a step that runs short preempts the most
recently admitted sequences (checkpointed into the host tier, or recomputed from their tokens) and they come back
where they stopped: every request's tokens equal a run with room for all, greedy and sampled; the pool comes back
whole."""
import pytest
import torch

from k3c.errors import ArgumentError
from k3c.runtime.engine import Engine
from k3c.runtime.prefix_cache import PrefixCache
from k3c.runtime.sampling import SamplingParams


def toks(spec, n, seed):
    return torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(tiny, **kw):
    spec, model, w = tiny
    eng = Engine(model, w, use_kernels=False, max_context=96, page_size=8, max_batch=4, **kw)
    rids = [eng.add_request(toks(spec, 20 + i, 40 + i), 22,
                            sampling=SamplingParams(temperature=0.9, seed=7) if i == 3 else None) for i in range(4)]
    peak = 0
    got: dict[int, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.rid, []).append(o.token)
        peak = max(peak, len(eng.running))
    return [got[r] for r in rids], eng, peak


@pytest.fixture(scope="module")
def reference(tiny):
    out, eng, peak = _run(tiny, num_pages=64)
    assert peak == 4 and eng.stats["preempted"] == 0
    return out


@pytest.mark.parametrize("cache", ["none", "host", "drop"])
def test_preempted_sequences_finish_as_if_never_preempted(tiny, one_thread, reference, cache):
    prefix = {"none": None, "host": PrefixCache(interval=1024, host_bytes=1 << 30),
              "drop": PrefixCache(interval=1024)}[cache]
    # 13 pages of 8 rows: four prompts of 20-23 tokens fit (3 pages each), their 42-45 token ends (6 each) do not
    out, eng, peak = _run(tiny, num_pages=13, admission="optimistic", prefix_cache=prefix)
    assert out == reference
    assert eng.stats["preempted"] > 0 and eng.stats["restored_preempted"] == eng.stats["preempted"] and peak >= 3
    if cache == "host":
        assert prefix.stats["parked"] > 0 and prefix.stats["restored_host"] > 0
        assert eng.stats["restored_preempted_tokens"] > 0          # they came back where they stopped
    elif cache == "none":
        assert eng.stats["restored_preempted_tokens"] == 0                # recomputed from their tokens
    if prefix is not None:
        assert prefix.stats["requests"] == 4                       # a re-admission is not a new request
        prefix.clear()
    eng.pool.check_empty()


def test_reserve_admission_never_preempts(tiny, one_thread, reference):
    out, eng, peak = _run(tiny, num_pages=13)
    assert out == reference and eng.stats["preempted"] == 0 and peak == 2    # 6 pages per worst case: two at a time
    eng.pool.check_empty()


def test_bad_admission(tiny):
    spec, model, w = tiny
    with pytest.raises(ArgumentError, match="admission must be one of reserve, optimistic"):
        Engine(model, w, use_kernels=False, admission="greedy")


def test_speculation_drops_drafts_rather_than_preempt(tiny, one_thread, reference):
    """Optimistic admission with prompt lookup on a tight pool: padded drafts that do not fit are dropped, never
    paid for by preempting a sequence; the greedy requests' tokens are the roomy run's (the sampled one draws
    through rejection sampling: other draws) and no more preemptions happen than in the same run without
    speculation."""
    from k3c.runtime.speculative import NgramDrafter, Speculation

    plain, eng_plain, _ = _run(tiny, num_pages=13, admission="optimistic")
    spec = Speculation(NgramDrafter(min_n=1), draft_len=6, adaptive=False)
    out, eng, _ = _run(tiny, num_pages=13, admission="optimistic", speculation=spec)
    assert plain == reference and out[:3] == reference[:3] and len(out[3]) == len(reference[3])
    assert eng.stats["spec_calls"] > 0 and eng.stats["spec_fallbacks"] > 0
    assert eng.stats["preempted"] <= eng_plain.stats["preempted"]
    eng.pool.check_empty()
