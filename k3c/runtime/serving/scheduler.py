"""The scheduler: which requests run (admission under `reserve` or `optimistic`, preemption when a step runs
short) and the segment each running sequence feeds next. It owns the waiting queue and the running batch; pages
are the ledger's."""
from __future__ import annotations

import time
from collections import Counter, deque

from ..caches.block_pool import CacheFullError
from ..caches.seq_state import SeqState
from .ledger import PageLedger


class Scheduler:
    def __init__(self, ledger: PageLedger, *, max_batch: int, admission: str, prefill_chunk: int | None,
                 prefix, kda_layers: list[int], stats: Counter):
        self.ledger = ledger
        self.max_batch = max_batch
        self.admission = admission
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix
        self.kda_layers = kda_layers
        self.stats = stats
        self.running: list[SeqState] = []
        self.waiting: deque[SeqState] = deque()

    def queue(self, seq: SeqState) -> None:
        self.waiting.append(seq)
        if self.prefix is not None:
            self.prefix.want(seq)

    def remove(self, seq: SeqState) -> None:
        """`seq` leaves the queue or the batch (its pages are the ledger's business)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            if self.prefix is not None:
                self.prefix.unwant(seq)
        if seq in self.running:
            self.running.remove(seq)

    # -- admission ----------------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Admit waiting requests in order while there is room. Under the prefix cache's working-set policy a
        request that must wait (its pages could only come from checkpoints it may not evict: PrefixCache.guard)
        lets those behind it try."""
        passed = []                             # requests left waiting this step, in queue order
        scan = self.prefix is not None and self.prefix.policy == "working-set"
        try:
            while self.waiting and len(self.running) < self.max_batch:
                seq = self.waiting.popleft()
                try:
                    admitted = self._admit_one(seq)
                except BaseException:
                    self.waiting.appendleft(seq)     # a refusal changes nothing: it stays first in line
                    raise
                if not admitted:
                    passed.append(seq)
                    if not scan:
                        break
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit_one(self, seq: SeqState) -> bool:
        limit = seq.preempted_at               # a preempted sequence resumes where it stopped, if a tier kept it
        if self.prefix is not None and not self.prefix.resume(seq, limit) and self.running:
            self.stats["admission_waits"] += 1
            return False                    # its checkpoint is offloaded and there is no room yet to bring it back
        pool = self.ledger.pool
        worst = seq.prompt_len + seq.max_new_tokens if self.admission == "reserve" else len(seq.tokens)
        need = pool.pages_for(worst) - len(seq.pages)
        if pool.used and seq.length % pool.page_size:
            need += 1                      # the shared partial last page may be copied
        if self.admission == "optimistic":
            need += len(self.running)           # headroom: a page per running sequence for its next step
        guard = self.prefix.guard(seq) if self.prefix is not None else 0
        if not self.ledger.make_room(need, guard, outstanding=True):
            self._unresume(seq)
            if not self.running and (not guard or not self.prefix.tiers()["device"]):
                # nothing will free pages (opened sequences hold them): waiting would be for ever
                raise CacheFullError(f"MLA cache full: request {seq.rid} needs {need} pages, "
                                     f"{pool.num_free} of {pool.num_pages} are free")
            self.stats["admission_waits"] += 1
            return False                    # wait for running requests to leave (or protected sessions to idle)
        self.ledger.promise(seq.rid, need)
        self.running.append(seq)
        seq.t_admitted = time.perf_counter()
        if seq.preempted_at is not None:        # back from a preemption: its prompt was counted once
            self.stats["restored_preempted"] += 1
            self.stats["restored_preempted_tokens"] += seq.resumed
            seq.preempted_at = None
            if self.prefix is not None:
                self.prefix.unwant(seq)
            return True
        self.stats["prompt_tokens"] += seq.prompt_len
        self.stats["resumed_tokens"] += seq.resumed
        if self.prefix is not None:
            self.prefix.record(seq)
        return True

    def fit(self, plan):
        """Optimistic admission: the plan cut to what the pool can hold, after moving prefix checkpoints off their
        pages, by preempting the most recently admitted sequences (never the last one: a lone sequence always fits,
        add_request checks it)."""
        while True:
            total = self.ledger.pages_needed(plan)
            if self.ledger.make_room(total) or len(plan) <= 1:
                return plan
            victim = max((s for s, _ in plan), key=lambda s: s.t_admitted)
            self.preempt(victim)
            plan = [(s, g) for s, g in plan if s is not victim]

    def preempt(self, seq: SeqState) -> None:
        """Take a running sequence off the device: its state becomes a prefix-cache checkpoint (kept in a tier below
        the device when the cache has one, else dropped: the sequence is recomputed from its tokens), its pages go
        back, and it waits first in line. Its tokens, sampler and budget of new tokens stay as they were."""
        self.stats["preempted"] += 1
        if self.prefix is not None and seq.length and seq.last_logits is not None:
            self.prefix.park(seq)
        self.running.remove(seq)
        seq.preempted_at = seq.length
        self._unresume(seq)
        self.waiting.appendleft(seq)
        if self.prefix is not None:
            self.prefix.want(seq, seq.preempted_at)

    def _unresume(self, seq: SeqState) -> None:
        """`seq` back to nothing cached (its pages and any promise released)."""
        self.ledger.release(seq)
        seq.length, seq.resumed, seq.last_logits = 0, 0, None
        seq.kda = {i: None for i in self.kda_layers}

    # -- segments -----------------------------------------------------------------------------------------------
    def segment(self, seq: SeqState) -> list[int]:
        """The tokens `seq` feeds next: the rest of what it knows, cut at prefill_chunk and at the next prefix-cache
        checkpoint boundary."""
        end = len(seq.tokens)
        if self.prefill_chunk:
            end = min(end, seq.length + self.prefill_chunk)
        if self.prefix is not None:
            iv = self.prefix.interval
            end = min(end, (seq.length // iv + 1) * iv)         # stop at the next checkpoint boundary
        return seq.tokens[seq.length:end]

    def boundary_room(self, seq: SeqState) -> int:
        """Tokens `seq` may take before it passes the next prefix-cache checkpoint boundary (a large number without a
        prefix cache)."""
        if self.prefix is None:
            return 1 << 62
        iv = self.prefix.interval
        return (seq.length // iv + 1) * iv - seq.length

    def maybe_checkpoint(self, seq: SeqState) -> None:
        if self.prefix is not None and (seq.length == seq.prompt_len or seq.length % self.prefix.interval == 0):
            self.prefix.insert(seq)
