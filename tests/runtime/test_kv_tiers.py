"""KV tiers and the working-set policy: offloaded checkpoints of one session share each page once per tier and resume
to the logits of a cold run; the policy's eviction order; admission that keeps an active session's checkpoint
resident (a cold request waits, a resuming one behind it goes first) where LRU would evict it."""
import os

import torch

from k3c.runtime.kv_tiers import page_keys
from k3c.runtime.prefix_cache import PrefixCache
from numerics import rel
from prefix_helpers import engine, serve, toks


def test_page_keys_name_prefixes():
    a, b = list(range(20)), list(range(16)) + [99, 98, 97, 96]
    ka, kb = page_keys(a, 20, 8), page_keys(b, 20, 8)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]          # pages 0-1 hold the same tokens
    assert page_keys(a, 16, 8) == ka[:2] and page_keys(a, 18, 8)[2] != ka[2]  # a partial page is its own


def test_offloaded_checkpoints_share_pages_and_resume(tiny, one_thread, tmp_path):
    spec, model, w = tiny
    # every checkpoint leaves the device at once (no device budget) for a host tier that holds them all
    pc = PrefixCache(interval=8, max_bytes=0, host_bytes=1 << 30)
    eng = engine(tiny, pc)
    base = toks(spec, 40, 1)
    _, outs = serve(eng, base, 4)             # checkpoints at 8, 16, 24, 32, 40 (prompt end) and 43 (finish)
    assert sorted(c.length for c in pc.entries.values()) == [8, 16, 24, 32, 40, 43]
    assert pc.tiers() == {"host": 6}
    # 1 + 2 + 3 + 4 + 5 + 6 = 21 page copies if each checkpoint kept its own rows; the session has 6 pages
    assert pc.host.pages == 6 and pc.stats["host_pages_shared"] == 15
    # five full pages and the 3 rows of the finish checkpoint's last page
    assert pc.tier_bytes("host") == (5 + 3 / 8) * eng.pool.page_bytes + sum(c.nbytes() for c in pc.entries.values())
    eng.pool.check_empty()                    # nothing on the device
    cold = engine(tiny)
    history = base + [o.token for o in outs][:3]
    for prompt, depth in ((history + toks(spec, 5, 2), 43), (base[:27] + toks(spec, 6, 3), 24)):
        seq, got = serve(eng, prompt, 3)
        assert seq.resumed == depth and seq.resumed_tier == "host"
        _, want = serve(cold, prompt, 3)
        assert [o.token for o in got] == [o.token for o in want]
        assert rel(torch.stack([o.logits for o in got]), torch.stack([o.logits for o in want])) <= 2e-5
    # down to disk: one file per page key and one per checkpoint's own states
    pc2 = PrefixCache(interval=8, max_bytes=0, host_bytes=1, disk=True, disk_dir=str(tmp_path))
    eng2 = engine(tiny, pc2)
    serve(eng2, base, 4)
    assert pc2.tiers() == {"disk": 6} and pc2.disk_tier.pages == 6 and pc2.host.pages == 0
    assert len(os.listdir(tmp_path)) == 6 + 6
    seq, got = serve(eng2, history + toks(spec, 5, 2), 3)
    _, want = serve(cold, history + toks(spec, 5, 2), 3)
    assert seq.resumed_tier == "disk" and [o.token for o in got] == [o.token for o in want]
    pc.clear(), pc2.clear()
    assert os.listdir(tmp_path) == [] and pc.host.pages == 0
    eng.pool.check_empty(), eng2.pool.check_empty()


def test_working_set_eviction_order(tiny, one_thread):
    spec, model, w = tiny
    now = [0.0]
    pc = PrefixCache(interval=1024, protect_s=5, clock=lambda: now[0], policy="working-set")
    eng = engine(tiny, pc)
    serve(eng, toks(spec, 12, 4), 2)          # session A: prompt end at 12 (superseded), finish at 13 (its leaf)
    now[0] = 10.0
    serve(eng, toks(spec, 12, 5), 2)          # session B, at t = 10
    now[0] = 12.0                             # A's leaf idle (12 s > 5 s), B's protected
    order = []
    while (c := pc._next("device", guard=2)) is not None:
        order.append((c.length, c.leaf, c.used))
        pc._demote(c)
    assert order == [(12, False, 0.0), (12, False, 10.0), (13, True, 0.0)]   # superseded first, then idle
    assert [(c.length, c.leaf) for c in pc.entries.values()] == [(13, True)]   # B's leaf: only when forced
    assert pc.evict_for_pages(guard=0) and not pc.entries
    eng.pool.check_empty()


def _contended(tiny, policy):
    """Session A's checkpoint holds 4 of 12 pages; R runs; a cold request C arrives before A's next turn."""
    spec, model, w = tiny
    now = [0.0]
    pc = PrefixCache(interval=1024, policy=policy, protect_s=10, clock=lambda: now[0])
    eng = engine(tiny, pc, num_pages=12)
    a_prompt = toks(spec, 30, 6)
    _, a_out = serve(eng, a_prompt, 2)                       # A's finish checkpoint at 31: pages 0..3
    r = eng.add_request(toks(spec, 30, 7), 10)               # reserves pages_for(40) = 5
    outs = eng.step()
    c = eng.add_request(toks(spec, 30, 8), 2)                # cold: 4 pages, only 3 free without A's checkpoint
    a1 = eng.add_request(a_prompt + [a_out[0].token] + toks(spec, 3, 9), 2)   # A goes on: resumes at 31
    outs += eng.step()
    state = {name: ("running" if eng.seqs[rid] in eng.running else "waiting") for name, rid in (("C", c), ("A1", a1))}
    resumed = eng.seqs[a1].resumed if eng.seqs[a1] in eng.running else 31 in {x.length for x in pc.entries.values()}
    for _ in range(40):                                      # R and A1 finish; C still waits for A's leaves to idle
        outs += eng.step()
    waited = c in eng.seqs and eng.seqs[c] in eng.waiting
    now[0] = 11.0                                            # protect_s has passed: C may displace them
    while eng.has_work():
        outs += eng.step()
    got = {k: [o.token for o in outs if o.rid == k] for k in (r, c, a1)}
    return state, resumed, got, eng, pc, waited


def test_admission_keeps_the_active_session_resident(tiny, one_thread):
    state, resumed, got, eng, pc, waited = _contended(tiny, "working-set")
    assert waited
    assert state == {"C": "waiting", "A1": "running"}       # C waits, A's next turn goes first
    assert resumed == 31 and eng.stats["admission_waits"] >= 1
    lru_state, lru_resumed, lru_got, lru_eng, lru_pc, _ = _contended(tiny, "lru")
    assert lru_state == {"C": "running", "A1": "waiting"}  # LRU: C evicts A's checkpoint, A1 will run cold
    assert lru_resumed is False
    assert got == lru_got                                                    # same tokens either way
    for e, p in ((eng, pc), (lru_eng, lru_pc)):
        p.clear()
        e.pool.check_empty()
