"""The serving engine's rooms on their own (runtime/serving/): the page ledger is the one writer of page references,
page lists and admission budgets; the scheduler's segments. No model, no graph: a pool of a few pages on the CPU."""
import pytest
import torch

from k3c.runtime.caches.block_pool import BlockPool, CacheFullError
from k3c.runtime.caches.seq_state import SeqState
from k3c.runtime.serving.ledger import PageLedger
from k3c.runtime.serving.scheduler import Scheduler


def _ledger(pages=6, page_size=4):
    pool = BlockPool(pages, page_size, {0: 3}, torch.float32, "cpu")
    return PageLedger(pool, torch.device("cpu"), lambda t: t)


def _seq(rid, n_tokens, length=0):
    return SeqState(rid, list(range(n_tokens)), n_tokens, length=length)


def test_reserve_commit_and_rollback_leave_the_pool_consistent():
    led = _ledger()
    a, b = _seq(0, 6), _seq(1, 3)
    led.promise(0, 2)
    undo = led.reserve([(a, a.tokens), (b, b.tokens)], evict=False)
    assert len(a.pages) == 2 and len(b.pages) == 1 and led.pool.num_free == 3
    assert led.budget[0] == 0 and led.outstanding() == 0          # the promise was claimed
    led.rollback(undo)
    assert a.pages == [] and b.pages == [] and led.pool.num_free == 6
    undo = led.reserve([(a, a.tokens)], evict=False)
    led.commit(undo)
    with pytest.raises(CacheFullError):                           # 5 pages for 20 tokens, 4 free: nothing changes
        led.reserve([(b, list(range(20)))], evict=False)
    assert b.pages == [] and led.pool.num_free == 4


def test_rewind_returns_whole_pages_to_the_pool_and_the_budget():
    led = _ledger()
    s = _seq(0, 10)
    led.promise(0, 3)
    led.commit(led.reserve([(s, s.tokens)], evict=False))
    led.written(s, 10)
    s.length = 10
    assert len(s.pages) == 3 and led.budget[0] == 0
    led.rewind(s, 5)                                  # pages 0-1 stay, page 2 goes back; page 1's mark comes down
    assert len(s.pages) == 2 and led.budget[0] == 1 and led.pool.num_free == 4
    assert led.pool.filled[s.pages[1]] == 1
    led.release(s)
    assert s.pages == [] and 0 not in led.budget
    led.pool.check_empty()


def test_shared_pages_are_held_and_dropped_through_the_ledger():
    led = _ledger()
    a = _seq(0, 4)
    led.commit(led.reserve([(a, a.tokens)], evict=False))
    held = list(a.pages)
    led.hold(held)                                    # a checkpoint keeps them
    b = _seq(1, 4)
    led.share(b, held)                                # a sequence resumed from it
    assert led.pool.ref[held[0]] == 3 and b.pages == held and b.pages is not a.pages
    led.release(a)
    led.release(b)
    assert led.pool.num_free == 5                     # the checkpoint still holds its page
    led.drop(held)
    led.pool.check_empty()


def test_a_shared_partial_page_is_copied_by_the_second_writer_of_one_call():
    led = _ledger()
    a = _seq(0, 6)
    led.commit(led.reserve([(a, a.tokens)], evict=False))
    led.written(a, 6)
    a.length = 6
    b = _seq(1, 8, length=0)
    led.share(b, a.pages)
    b.length = 6
    needs = led.needs([(a, [1]), (b, [1, 2])])
    assert needs == [(0, False), (0, True)]           # a writes in place, b copies the partial page first


def test_segments_stop_at_prefill_chunks_and_checkpoint_boundaries():
    class Prefix:
        interval, policy = 8, "lru"

    sched = Scheduler(_ledger(), max_batch=2, admission="reserve", prefill_chunk=5, prefix=Prefix(),
                      kda_layers=[], stats=None)
    s = _seq(0, 20)
    assert sched.segment(s) == list(range(5))
    s.length = 5
    assert sched.segment(s) == [5, 6, 7] and sched.boundary_room(s) == 3
