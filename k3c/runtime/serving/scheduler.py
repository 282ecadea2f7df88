"""The scheduler: which requests run (admission under `reserve` or `optimistic`, preemption when a step runs
short), the segment each running sequence feeds next and how many prompt tokens a step takes (the step token
budget: StepBudget). It owns the waiting queue and the running batch; pages are the ledger's. What it decides for
one step is a StepPlan."""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from ..caches.block_pool import CacheFullError
from ..caches.seq_state import SeqState
from .ledger import PageLedger

# Prompt tokens a step takes at least while prompts wait, whatever the budget's or the latency target's room (one
# KDA sub-chunk): a prompt always progresses, even behind more decoding rows than the budget holds.
PREFILL_FLOOR = 16


@dataclass
class StepPlan:
    """What the scheduler decided for one step: the requests admitted into the running batch, every sequence's
    segment (the token ids it feeds; decoding rows one token, prompts a chunk), the sequences preempted to make
    room. Plain data: a multi-rank server sends `rows()` and the id lists to its other ranks."""
    segments: list[tuple[SeqState, list[int]]] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)       # request ids, in admission order
    preempted: list[int] = field(default_factory=list)
    decode_tokens: int = 0                                  # rows feeding one generated token
    prefill_tokens: int = 0                                 # prompt (or recomputed) tokens

    def rows(self) -> list[tuple[int, list[int]]]:
        return [(seq.rid, seg) for seq, seg in self.segments]


class StepBudget:
    """How many prompt tokens a step takes beside its decoding rows (chunked prefill).

    max_tokens (None: no cap) bounds a step's tokens, decoding rows included: prompts get what the decoding rows
    leave, in admission order (the oldest prompt first: its first token comes soonest), each cut to a chunk.

    itl_target (seconds; None: off) is the admission rule for latency: while sequences decode, a step takes only
    the prompt tokens the measured costs say fit in the target, room = (itl_target - decode step) / prefill
    seconds per token, both moving averages of measured steps that decoded (their sampling syncs the device, so
    their wall time is the device's; steps that captured graphs or verified drafts are no samples). Until a mixed
    step has been measured the room is max_tokens'. With no one decoding there is no latency to keep and prompts
    get max_tokens' room. Either limit gives way to PREFILL_FLOOR, so prompts never starve."""

    ALPHA = 0.25                  # weight of the newest sample in the moving averages

    def __init__(self, max_tokens: int | None = None, itl_target: float | None = None):
        self.max_tokens, self.itl_target = max_tokens, itl_target
        self.decode_s: float | None = None         # seconds of a decode-only step
        self.token_s: float | None = None          # seconds a prompt token adds to a step

    def prefill_room(self, decode_tokens: int) -> float:
        """Prompt tokens the next step may take beside `decode_tokens` decoding rows (math.inf: no limit)."""
        room = math.inf if self.max_tokens is None else self.max_tokens - decode_tokens
        if self.itl_target is not None and decode_tokens and self.token_s is not None:
            fits = (self.itl_target - (self.decode_s or 0.0)) / max(self.token_s, 1e-12)
            room = min(room, int(fits))
        return max(room, min(PREFILL_FLOOR, self.max_tokens or PREFILL_FLOOR))

    def observe(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """A measured step that decoded `decode_tokens` rows beside `prefill_tokens` prompt tokens."""
        if not decode_tokens:
            return
        if not prefill_tokens:
            self.decode_s = self._avg(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.token_s = self._avg(self.token_s, max(seconds - self.decode_s, 0.0) / prefill_tokens)

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new


class Scheduler:
    def __init__(self, ledger: PageLedger, *, max_batch: int, admission: str, prefill_chunk: int | None,
                 prefix, kda_layers: list[int], stats: Counter, budget: StepBudget | None = None):
        self.ledger = ledger
        self.budget = budget if budget is not None else StepBudget()
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
    def plan(self) -> StepPlan:
        """This step: admit what has room, then every running sequence's segment: each decoding row its token,
        prompts chunks of what the budget leaves (StepBudget.prefill_room), in admission order."""
        step = StepPlan(admitted=self.admit())
        rows = [s for s in self.running if s.pending > 0]
        decoding = {s.rid for s in rows if s.generated and s.pending == 1}
        room = self.budget.prefill_room(len(decoding))
        for seq in rows:
            if seq.rid in decoding:
                step.segments.append((seq, seq.tokens[seq.length:]))
                step.decode_tokens += 1
            elif room > 0:
                seg = self.segment(seq, limit=room)
                step.segments.append((seq, seg))
                step.prefill_tokens += len(seg)
                room -= len(seg)
        return step

    def admit(self) -> list[int]:
        """Admit waiting requests in order while there is room (their ids). Under the prefix cache's working-set
        policy a request that must wait (its pages could only come from checkpoints it may not evict:
        PrefixCache.guard) lets those behind it try."""
        admitted_ids = []
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
                else:
                    admitted_ids.append(seq.rid)
        finally:
            self.waiting.extendleft(reversed(passed))
        return admitted_ids

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

    def fit(self, step: StepPlan) -> None:
        """Optimistic admission: the step's segments cut to what the pool can hold, after moving prefix checkpoints
        off their pages, by preempting the most recently admitted sequences (never the last one: a lone sequence
        always fits, add_request checks it)."""
        while True:
            total = self.ledger.pages_needed(step.segments)
            if self.ledger.make_room(total) or len(step.segments) <= 1:
                return
            victim, seg = max(step.segments, key=lambda sg: sg[0].t_admitted)
            self.preempt(victim)
            step.segments = [(s, g) for s, g in step.segments if s is not victim]
            step.preempted.append(victim.rid)
            if len(seg) == 1 and victim.generated:
                step.decode_tokens -= 1
            else:
                step.prefill_tokens -= len(seg)

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
    def segment(self, seq: SeqState, limit: float = math.inf) -> list[int]:
        """The tokens `seq` feeds next: the rest of what it knows, cut at prefill_chunk, at `limit` tokens (the
        step's room) and at the next prefix-cache checkpoint boundary."""
        end = len(seq.tokens)
        if self.prefill_chunk:
            end = min(end, seq.length + self.prefill_chunk)
        if limit < end - seq.length:
            end = seq.length + int(limit)
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
