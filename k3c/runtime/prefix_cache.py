"""Prefix cache for hybrid KDA + MLA models.

A KDA state at an arbitrary token cannot be recovered from later ones, so the cache keeps checkpoints: at every
prompt end, every `interval` tokens (default 32768) and when a request finishes. A checkpoint of the first n tokens
holds each KDA layer's state and conv tails (one sequence), the logits at token n-1 (so an identical prompt needs no
compute at all), and the MLA latent rows [0, n): on the device as page ids shared by reference count with the
sequences that wrote them, once offloaded as page keys into a tier (kv_tiers.py: a page stored once per tier, however
many checkpoints hold it). AttnRes keeps nothing across tokens (caches/seq_state.py).

A new request resumes from the deepest checkpoint inside its prompt (matched by a SHA-256 of the token prefix) and
recomputes the rest. Device checkpoints are evicted when their bytes pass `max_bytes` or when the engine needs
pages: to host memory (pinned with CUDA) when `host_bytes` > 0, from there to safetensors files when `disk` is on,
else dropped.

Which checkpoint goes first is the policy:
  - "lru" (the default): the least recently used.
  - "working-set" (for multi-turn sessions past the pool's size): a session's newest checkpoint (a *leaf*: nothing has resumed from it or extended
    it yet) used within `protect_s` seconds is the working set of an active session, whose next turn will resume
    from it. Superseded checkpoints go first, then leaves idle past protect_s, least recently used first within each
    class; protected leaves only when nothing else is left, and a checkpoint a waiting request will resume from
    last of all. The engine asks how far a request's admission may go (`guard`): while requests are running, one
    that would start cold may not evict protected checkpoints, one that resumes may not evict the checkpoints that
    other waiting requests want; a request that would have to waits, and requests behind it may go first. On an
    idle engine a cold request that waited protect_s may displace protected checkpoints, one per protect_s. Under LRU, more
    sessions than the pool holds evict each other's next checkpoint in turn (the hit rate falls off a cliff); here
    the sessions that fit keep hitting and the others queue until resident sessions end. The cost is queueing (new
    sessions wait for room; a cold request can wait protect_s while the device idles): LRU stays the default, for
    requests that are not sessions.
"""
from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import ArgumentError
from .caches.block_pool import CacheFullError
from .kv_tiers import DiskTier, HostTier, page_keys
from ..reference.kda import KDAState
from .caches.seq_state import SeqState, clone_row, state_bytes

POLICIES = ("lru", "working-set")
GUARD_NONE, GUARD_WANTED, GUARD_WORKING_SET = 0, 1, 2     # what an eviction for pages must spare (guard())


@dataclass
class Checkpoint:
    key: bytes
    length: int
    kda: dict[int, KDAState]
    logits: torch.Tensor
    page_keys: list[bytes] = field(default_factory=list)   # content key of each MLA page (kv_tiers.page_keys)
    tier: str = "device"                        # device | host | disk
    pages: list[int] | None = None              # device tier: page ids (one reference each)
    leaf: bool = True                           # nothing resumed from it or extended it yet
    used: float = 0.0                           # when it was inserted or last resumed from (the cache's clock)
    wanted: int = 0                             # waiting requests that would resume from it

    def nbytes(self) -> int:
        """Bytes of its own (KDA states and logits; pages are counted once per tier by the cache)."""
        return sum(state_bytes(s) for s in self.kda.values()) + self.logits.numel() * self.logits.element_size()


def _key(tokens) -> bytes:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class PrefixCache:
    def __init__(self, *, interval: int = 32768, max_bytes: int = 8 << 30, host_bytes: int = 0, disk: bool = False,
                 disk_dir: str | None = None, on_finish: bool = True, policy: str = "lru",
                 protect_s: float = 60.0, clock=time.monotonic):
        for name, v in (("interval", interval), ("max_bytes", max_bytes), ("host_bytes", host_bytes)):
            low = 1 if name == "interval" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ArgumentError(f"prefix cache {name} must be a {'positive' if low else 'non-negative'} integer, "
                                    f"got {v!r}")
        if policy not in POLICIES:
            raise ArgumentError(f"prefix cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if isinstance(protect_s, bool) or not isinstance(protect_s, (int, float)) or not protect_s >= 0:
            raise ArgumentError(f"prefix cache protect_s must be a non-negative number of seconds, got {protect_s!r}")
        self.interval, self.max_bytes, self.host_bytes = interval, max_bytes, host_bytes
        self.disk, self.on_finish = disk, on_finish
        self.policy, self.protect_s, self.clock = policy, float(protect_s), clock
        self.host: HostTier | None = None           # made on attach (pinned memory needs the engine's device)
        self.disk_tier = DiskTier(disk_dir) if disk else None
        self.entries: OrderedDict[bytes, Checkpoint] = OrderedDict()     # least recently used first
        self._lengths: Counter = Counter()
        self._page_holders: Counter = Counter()                            # page -> device checkpoints
        self._newest: dict[int, bytes] = {}                                # rid -> its newest checkpoint
        self._displaced_at = float("-inf")          # the last cold admission allowed to displace the working set
        self.stats = Counter()
        self.ledger = None                          # the engine's page ledger: every page reference goes through it
        self._busy = lambda: False                  # whether the engine runs requests (attach)
        self._kda_layers: list[int] = []
        self._device = None

    def attach(self, ledger, *, kda_layers: list[int], busy) -> None:
        """Serve the engine whose page ledger is `ledger` (the cache's pages and device come from it): its KDA
        layers are `kda_layers`, and `busy()` says whether it is running requests (what guard() protects)."""
        if self.ledger is not None and self.ledger is not ledger:
            raise ArgumentError("a PrefixCache serves one engine")
        self.ledger, self._busy = ledger, busy
        self._kda_layers, self._device = list(kda_layers), ledger.device
        if self.host is None:
            self.host = HostTier(pin=ledger.device.type == "cuda")

    @property
    def pool(self):
        return self.ledger.pool

    # -- accounting ---------------------------------------------------------------------------------------------
    def tier_bytes(self, tier: str) -> int:
        """Bytes a tier holds for the cache: its checkpoints' own bytes plus each page once."""
        n = sum(c.nbytes() for c in self.entries.values() if c.tier == tier and tier != "disk")
        if tier == "device":
            n += len(self._page_holders) * self.pool.page_bytes
        elif tier == "host":
            n += self.host.nbytes if self.host is not None else 0
        elif self.disk_tier is not None:
            n += self.disk_tier.nbytes + sum(c.nbytes() for c in self.entries.values() if c.tier == "disk")
        return n

    def device_pages(self) -> int:
        """Pool pages the device checkpoints hold (each counted once, however many checkpoints share it)."""
        return len(self._page_holders)

    def hit_rate(self) -> float:
        """Share of admitted prompt tokens taken from the cache."""
        return self.stats["hit_tokens"] / self.stats["prompt_tokens"] if self.stats["prompt_tokens"] else 0.0

    # -- lookup and resume --------------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], limit: int) -> Checkpoint | None:
        """The deepest checkpoint whose tokens are a prefix of tokens[:limit]."""
        arr = np.asarray(tokens[:limit], dtype=np.int64)
        h, prev, best = hashlib.sha256(), 0, None
        for n in sorted(x for x in self._lengths if x <= limit):
            h.update(arr[prev:n].tobytes())
            prev = n
            c = self.entries.get(h.copy().digest())
            if c is not None and c.length == n:
                best = c
        return best

    def resume(self, seq: SeqState, limit: int | None = None) -> bool:
        """Start `seq` (fresh, not admitted yet) from the deepest checkpoint inside its first `limit` tokens (default
        its prompt), if any. An offloaded one comes back into pages freed, if need be, by moving device checkpoints
        down; False when even that leaves no room (the request should wait rather than recompute what a tier
        holds), True otherwise (resumed, or nothing to resume from)."""
        c = self.lookup(seq.tokens, seq.prompt_len if limit is None else limit)
        if c is None:
            return True
        pool, device = self.pool, self._device
        if c.tier == "device":
            self.ledger.share(seq, c.pages)
            kda = c.kda
        else:
            n = pool.pages_for(c.length)
            guard = GUARD_WANTED if self._busy() else GUARD_NONE
            while pool.num_free < n and self.evict_for_pages(guard):
                pass
            if pool.num_free < n:
                self.stats["restore_waits"] += 1
                return False
            tier = self.host if c.tier == "host" else self.disk_tier
            self.ledger.restore(seq, n, (tier.rows(k) for k in c.page_keys))
            kda, logits = self._states(c)
            kda = {i: KDAState(s.state.to(device, non_blocking=True),
                               tuple(t.to(device, non_blocking=True) for t in s.conv)) for i, s in kda.items()}
            self.stats[f"restored_{c.tier}"] += 1
            self.stats["restored_bytes"] += n * pool.page_bytes
        seq.length, seq.resumed = c.length, c.length
        seq.resumed_tier = c.tier
        seq.kda = {i: (kda[i], 0) for i in self._kda_layers}
        seq.last_logits = (c.logits if c.tier == "device" else logits).to(device, non_blocking=True)
        seq.resumed_from = c.key
        return True

    def record(self, seq: SeqState) -> None:
        """`seq` was admitted: count it; the checkpoint it resumed from is superseded (its session goes on: the
        new checkpoints are the leaves) and most recently used."""
        self.unwant(seq)
        c = self.entries.get(seq.resumed_from) if seq.resumed else None
        if c is not None:
            c.leaf, c.used = False, self.clock()
            self.entries.move_to_end(c.key)
        self.stats["requests"] += 1
        self.stats["hits"] += bool(seq.resumed)
        self.stats["hit_tokens"] += seq.resumed
        self.stats["prompt_tokens"] += seq.prompt_len

    # -- admission ----------------------------------------------------------------------------------------------
    def protected(self, c: Checkpoint, now: float) -> bool:
        """Part of an active session's working set (policy working-set): a leaf used within protect_s, or one a
        waiting request will resume from (however long it waits)."""
        return self.policy == "working-set" and ((c.leaf and now - c.used <= self.protect_s) or c.wanted > 0)

    def want(self, seq: SeqState, limit: int | None = None) -> None:
        """`seq` was queued: the checkpoint it would resume from now (inside its first `limit` tokens, default its
        prompt) is wanted until it is admitted or leaves."""
        seq.queued_at = self.clock()
        if self.policy != "working-set":
            return
        c = self.lookup(seq.tokens, seq.prompt_len if limit is None else limit)
        if c is not None:
            c.wanted += 1
            seq.wants = c.key

    def unwant(self, seq: SeqState) -> None:
        c = self.entries.get(seq.wants) if seq.wants is not None else None
        if c is not None:
            c.wanted -= 1
        seq.wants = None

    def guard(self, seq: SeqState) -> int:
        """What admitting `seq` may not evict for its pages (GUARD_*). Under LRU: nothing. Under working-set a
        request that resumes (its session goes on) keeps what other waiting requests want (nothing when the engine
        is idle: then no one else will free pages); a cold one keeps the whole working set (sessions are admitted
        as resident ones end, not by displacing them a turn at a time, which is the LRU cliff again), except that
        on an idle engine one cold request per protect_s that has waited protect_s may displace protected
        checkpoints (a bound on the device idling for room, and on how fast such displacements churn)."""
        if self.policy != "working-set":
            return GUARD_NONE
        if seq.resumed:
            return GUARD_WANTED if self._busy() else GUARD_NONE
        now = self.clock()
        if self._busy() or seq.queued_at is None or now - seq.queued_at <= self.protect_s \
                or now - self._displaced_at <= self.protect_s:
            return GUARD_WORKING_SET
        self._displaced_at = now
        self.stats["displacing_admissions"] += 1
        return GUARD_WANTED

    # -- insert and evict ---------------------------------------------------------------------------------------
    def insert(self, seq: SeqState, final: bool = False) -> None:
        """Checkpoint the first seq.length tokens of a sequence (its state right now); `final`: its last one."""
        n = seq.length
        if n == 0 or seq.last_logits is None:
            return
        key = _key(seq.tokens[:n])
        prev = self.entries.get(self._newest.pop(seq.rid, b""))
        if prev is not None and prev.key != key:
            prev.leaf = False                            # superseded by this one
        if not final:
            self._newest[seq.rid] = key
        c = self.entries.get(key)
        if c is not None:
            self.entries.move_to_end(key)
            c.used = self.clock()
            return
        pages = list(seq.pages[: self.pool.pages_for(n)])
        self.ledger.hold(pages)
        for p in pages:
            self._page_holders[p] += 1
        kda = {i: clone_row(seq.kda[i]) for i in self._kda_layers}
        keys = page_keys(seq.tokens, n, self.pool.page_size) if self.pool.used else []
        self.entries[key] = Checkpoint(key, n, kda, seq.last_logits.detach().clone(), keys, pages=pages,
                                       used=self.clock())
        self._lengths[n] += 1
        self.stats["inserted"] += 1
        self._enforce()

    def park(self, seq: SeqState) -> None:
        """A preempted running sequence: checkpoint it and move that checkpoint off the device at once (to the host
        or disk tier, or dropped when there is none: the engine then recomputes the sequence)."""
        self.insert(seq)
        c = self.entries.get(_key(seq.tokens[:seq.length]))
        if c is not None and c.tier == "device":
            self._demote(c)
            self.stats["parked"] += 1

    def forget(self, rid: int) -> None:
        """A sequence left without a final checkpoint: stop tracking its newest one."""
        self._newest.pop(rid, None)

    def _enforce(self) -> None:
        while self.tier_bytes("device") > self.max_bytes and self._demote_next("device"):
            pass
        while self.host_bytes and self.tier_bytes("host") > self.host_bytes and self._demote_next("host"):
            pass

    def evict_for_pages(self, guard: int = 0) -> bool:
        """Move one device checkpoint off the pages (the engine needs room), in policy order, sparing what `guard`
        keeps (GUARD_*). False: none left to move."""
        return self._demote_next("device", guard)

    def _next(self, tier: str, guard: int = 0) -> Checkpoint | None:
        """The checkpoint of `tier` to move first: LRU, or under working-set superseded ones, then idle leaves, then
        protected leaves, then those waiting requests want, least recently used first within each class; None
        when only classes `guard` keeps are left."""
        if self.policy == "lru":
            return next((c for c in self.entries.values() if c.tier == tier), None)
        now, first = self.clock(), [None, None, None, None]
        for c in self.entries.values():
            if c.tier != tier:
                continue
            cls = 3 if c.wanted else 2 if self.protected(c, now) else int(c.leaf)
            if cls == 0:
                return c
            if first[cls] is None:
                first[cls] = c
        return next((c for c in first[1:4 - guard] if c is not None), None)

    def _demote_next(self, tier: str, guard: int = 0) -> bool:
        c = self._next(tier, guard)
        if c is None:
            return False
        self._demote(c)
        return True

    def _release_pages(self, c: Checkpoint) -> None:
        for p in c.pages:
            self._page_holders[p] -= 1
            if not self._page_holders[p]:
                del self._page_holders[p]
        self.ledger.drop(c.pages)
        c.pages = None

    def _page_rows(self, c: Checkpoint):
        """(page key, a function giving that page's rows on the host) for every page of a device checkpoint."""
        ps, host = self.pool.page_size, self.host
        for i, (p, k) in enumerate(zip(c.pages, c.page_keys)):
            rows = min(ps, c.length - i * ps)
            yield k, (lambda p=p, rows=rows: {layer: host.to_host(t)
                                              for layer, t in self.pool.page_rows(p, rows).items()})

    def _demote(self, c: Checkpoint) -> None:
        if c.tier == "device":
            if self.host_bytes:
                shared = sum(not self.host.hold(k, rows) for k, rows in self._page_rows(c))
                to = self.host.to_host
                c.kda = {i: KDAState(to(s.state), tuple(to(t) for t in s.conv)) for i, s in c.kda.items()}
                c.logits = to(c.logits)
                self._release_pages(c)
                c.tier = "host"
                self.stats["offloaded_host"] += 1
                self.stats["host_pages_shared"] += shared
                return
            if self.disk:
                for k, rows in self._page_rows(c):
                    self.disk_tier.hold(k, lambda rows=rows: self._settled(rows()))
                self._release_pages(c)
                self._to_disk(c)
                return
            self._drop(c)
            return
        if c.tier == "host" and self.disk:
            self.host.settle()
            for k in c.page_keys:
                self.disk_tier.hold(k, lambda k=k: self.host.rows(k))
                self.host.release(k)
            self._to_disk(c)
            return
        self._drop(c)

    def _settled(self, rows):
        self.host.settle()                  # the host reads them next: the queued copies must have run
        return rows

    def _to_disk(self, c: Checkpoint) -> None:
        """The checkpoint's own states to a file of its own (its pages are in the disk tier already)."""
        self.host.settle()
        tensors = {"logits": c.logits}
        for i, s in c.kda.items():
            tensors[f"kda.{i}.state"] = s.state
            for j, t in enumerate(s.conv):
                tensors[f"kda.{i}.conv{j}"] = t
        self.disk_tier.save("ckpt-" + c.key.hex()[:40], tensors)
        c.kda = {i: KDAState(s.state[:0], tuple(t[:0] for t in s.conv)) for i, s in c.kda.items()}  # shapes only
        c.logits = c.logits[:0]
        c.tier = "disk"
        self.stats["offloaded_disk"] += 1

    def _states(self, c: Checkpoint) -> tuple[dict[int, KDAState], torch.Tensor]:
        """(KDA states, logits) of an offloaded checkpoint, on the host."""
        if c.tier == "host":
            return c.kda, c.logits
        t = self.disk_tier.load("ckpt-" + c.key.hex()[:40])
        kda = {i: KDAState(t[f"kda.{i}.state"], tuple(t[f"kda.{i}.conv{j}"] for j in range(3))) for i in c.kda}
        return kda, t["logits"]

    def _drop(self, c: Checkpoint) -> None:
        if c.tier == "device":
            self._release_pages(c)
        elif c.tier == "host":
            for k in c.page_keys:
                self.host.release(k)
        else:
            for k in c.page_keys:
                self.disk_tier.release(k)
            self.disk_tier.remove("ckpt-" + c.key.hex()[:40])
        del self.entries[c.key]
        self._lengths[c.length] -= 1
        if not self._lengths[c.length]:
            del self._lengths[c.length]
        self.stats["evicted"] += 1

    def clear(self) -> None:
        """Drop every checkpoint (their pages go back to the pool; files are deleted)."""
        for c in list(self.entries.values()):
            self._drop(c)
        self._newest.clear()
        if self.disk_tier is not None:
            self.disk_tier.cleanup()

    def tiers(self) -> Counter:
        return Counter(c.tier for c in self.entries.values())
