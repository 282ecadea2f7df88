"""Prefix cache for hybrid KDA + MLA models.

A KDA state at an arbitrary token cannot be recovered from later ones, so the cache keeps checkpoints: at every
prompt end, every `interval` tokens (default 32768) and when a request finishes. A checkpoint of the first n tokens
holds each KDA layer's state and conv tails (one sequence), the logits at token n-1 (so an identical prompt needs no
compute at all), and the MLA latent rows [0, n): on the device as page ids shared by reference count with the
sequences that wrote them, once offloaded as page keys into a tier (kv_tiers.py: a page stored once per tier, however
many checkpoints hold it). AttnRes keeps nothing across tokens (seq_state.py).

A new request resumes from the deepest checkpoint inside its prompt (matched by a SHA-256 of the token prefix) and
recomputes the rest. Device checkpoints are evicted when their bytes pass `max_bytes` or when the engine needs
pages: to host memory (pinned with CUDA) when `host_bytes` > 0, from there to safetensors files when `disk` is on,
else dropped.

Which checkpoint goes first is the policy:
  - "lru": the least recently used.
  - "working-set" (the default): a session's newest checkpoint (a *leaf*: nothing has resumed from it or extended
    it yet) used within `protect_s` seconds is the working set of an active session, whose next turn will resume
    from it. Superseded checkpoints go first, then leaves idle past protect_s, least recently used first within each
    class; protected leaves only when nothing else is left. And the engine asks before admitting a request that
    would start cold (`admits`): while requests are running, one whose pages could only come from protected leaves
    waits instead, and requests behind it that resume may go first. Under LRU, more sessions than the pool holds
    evict each other's next checkpoint in turn (the hit rate falls off a cliff); here the sessions that fit keep
    hitting and the others queue until a session goes idle.
"""
from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import ArgumentError
from .block_pool import CacheFullError
from .kv_tiers import DiskTier, HostTier, page_keys
from ..reference.kda import KDAState
from .seq_state import SeqState, clone_row, state_bytes

POLICIES = ("working-set", "lru")


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

    def nbytes(self) -> int:
        """Bytes of its own (KDA states and logits; pages are counted once per tier by the cache)."""
        return sum(state_bytes(s) for s in self.kda.values()) + self.logits.numel() * self.logits.element_size()


def _key(tokens) -> bytes:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class PrefixCache:
    def __init__(self, *, interval: int = 32768, max_bytes: int = 8 << 30, host_bytes: int = 0, disk: bool = False,
                 disk_dir: str | None = None, on_finish: bool = True, policy: str = "working-set",
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
        self.stats = Counter()
        self.engine = None

    def attach(self, engine) -> None:
        if self.engine is not None and self.engine is not engine:
            raise ArgumentError("a PrefixCache serves one engine")
        self.engine = engine
        if self.host is None:
            self.host = HostTier(pin=engine.device.type == "cuda")

    @property
    def pool(self):
        return self.engine.pool

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

    def resume(self, seq: SeqState, limit: int | None = None) -> None:
        """Start `seq` (fresh, not admitted yet) from the deepest checkpoint inside its first `limit` tokens (default
        its prompt), if any, and if there is room to bring an offloaded one back."""
        c = self.lookup(seq.tokens, seq.prompt_len if limit is None else limit)
        if c is None:
            return
        eng, pool = self.engine, self.pool
        if c.tier == "device":
            pages = list(c.pages)
            pool.incref(pages)
            kda = c.kda
        else:
            try:
                pages = pool.alloc(pool.pages_for(c.length))
            except CacheFullError:
                return                                   # no room to bring it back: run cold
            tier = self.host if c.tier == "host" else self.disk_tier
            for p, k in zip(pages, c.page_keys):
                pool.write_page(p, tier.rows(k))
            kda, logits = self._states(c)
            kda = {i: KDAState(s.state.to(eng.device, non_blocking=True),
                               tuple(t.to(eng.device, non_blocking=True) for t in s.conv)) for i, s in kda.items()}
            self.stats[f"restored_{c.tier}"] += 1
            self.stats["restored_bytes"] += len(pages) * pool.page_bytes
        seq.pages, seq.length, seq.resumed = pages, c.length, c.length
        seq.resumed_tier = c.tier
        seq.kda = {i: (kda[i], 0) for i in eng.kda_layers}
        seq.last_logits = (c.logits if c.tier == "device" else logits).to(eng.device, non_blocking=True)
        seq.resumed_from = c.key

    def record(self, seq: SeqState) -> None:
        """`seq` was admitted: count it; the checkpoint it resumed from is superseded (its session goes on: the
        new checkpoints are the leaves) and most recently used."""
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
        """Part of an active session's working set (policy working-set): a leaf used within protect_s."""
        return self.policy == "working-set" and c.leaf and now - c.used <= self.protect_s

    def admits(self, seq: SeqState) -> bool:
        """Whether admitting `seq` may evict protected checkpoints for its pages: under working-set only a request
        that resumes (a session going on) may, or any request when nothing is running (nothing else would free
        pages)."""
        return self.policy != "working-set" or bool(seq.resumed) or not self.engine.running

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
        self.pool.incref(pages)
        for p in pages:
            self._page_holders[p] += 1
        kda = {i: clone_row(seq.kda[i]) for i in self.engine.kda_layers}
        keys = page_keys(seq.tokens, n, self.pool.page_size) if self.pool.used else []
        self.entries[key] = Checkpoint(key, n, kda, seq.last_logits.detach().clone(), keys, pages=pages,
                                       used=self.clock())
        self._lengths[n] += 1
        self.stats["inserted"] += 1
        self._enforce()

    def forget(self, rid: int) -> None:
        """A sequence left without a final checkpoint: stop tracking its newest one."""
        self._newest.pop(rid, None)

    def _enforce(self) -> None:
        while self.tier_bytes("device") > self.max_bytes and self._demote_next("device"):
            pass
        while self.host_bytes and self.tier_bytes("host") > self.host_bytes and self._demote_next("host"):
            pass

    def evict_for_pages(self, protect: bool = False) -> bool:
        """Move one device checkpoint off the pages (the engine needs room), in policy order; `protect`: never a
        protected one. False: none left to move."""
        return self._demote_next("device", protect)

    def _next(self, tier: str, protect: bool = False) -> Checkpoint | None:
        """The checkpoint of `tier` to move first: LRU, or under working-set superseded ones, then idle leaves, then
        (unless `protect`) protected leaves, least recently used first within each class."""
        now, idle, guarded = self.clock(), None, None
        for c in self.entries.values():
            if c.tier != tier:
                continue
            if self.policy == "lru" or not c.leaf:
                return c
            if not self.protected(c, now):
                idle = idle or c
            else:
                guarded = guarded or c
        return idle or (None if protect else guarded)

    def _demote_next(self, tier: str, protect: bool = False) -> bool:
        c = self._next(tier, protect)
        if c is None:
            return False
        self._demote(c)
        return True

    def _release_pages(self, c: Checkpoint) -> None:
        for p in c.pages:
            self._page_holders[p] -= 1
            if not self._page_holders[p]:
                del self._page_holders[p]
        self.pool.decref(c.pages)
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
