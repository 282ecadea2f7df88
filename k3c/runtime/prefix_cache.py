"""Prefix cache for hybrid KDA + MLA models.

A KDA state at an arbitrary token cannot be recovered from later ones, so the cache keeps checkpoints: at every
prompt end, every `interval` tokens (default 32768) and when a request finishes. A checkpoint of the first n tokens
holds each KDA layer's state and conv tails (one sequence), the logits at token n-1 (so an identical prompt needs no
compute at all), and the MLA latent rows [0, n): on the device as page ids shared by reference count with the
sequences that wrote them, or, once offloaded, as plain rows. AttnRes keeps nothing across tokens (seq_state.py).

A new request resumes from the deepest checkpoint inside its prompt (matched by a SHA-256 of the token prefix) and
recomputes the rest. Device checkpoints are evicted least-recently-used when their bytes pass `max_bytes` or when the
engine needs pages: to host memory (pinned with CUDA) when `host_bytes` > 0, from there to safetensors files in a
temp dir when `disk` is on, else dropped.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ArgumentError
from .block_pool import CacheFullError
from ..reference.kda import KDAState
from .seq_state import SeqState, clone_row, state_bytes


@dataclass
class Checkpoint:
    key: bytes
    length: int
    kda: dict[int, KDAState]
    logits: torch.Tensor
    tier: str = "device"                        # device | host | disk
    pages: list[int] | None = None              # device tier: page ids (one reference each)
    latent: dict[int, torch.Tensor] | None = None   # host tier: MLA rows [length, W] per layer
    path: str | None = None                     # disk tier

    def nbytes(self) -> int:
        """Bytes held besides device pages (counted once per page by the cache)."""
        n = sum(state_bytes(s) for s in self.kda.values()) + self.logits.numel() * self.logits.element_size()
        if self.latent:
            n += sum(t.numel() * t.element_size() for t in self.latent.values())
        return n


def _key(tokens) -> bytes:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class PrefixCache:
    def __init__(self, *, interval: int = 32768, max_bytes: int = 8 << 30, host_bytes: int = 0, disk: bool = False,
                 disk_dir: str | None = None, on_finish: bool = True):
        for name, v in (("interval", interval), ("max_bytes", max_bytes), ("host_bytes", host_bytes)):
            low = 1 if name == "interval" else 0
            if not isinstance(v, int) or v < low:
                raise ArgumentError(f"prefix cache {name} must be a {'positive' if low else 'non-negative'} integer, "
                                    f"got {v!r}")
        self.interval, self.max_bytes, self.host_bytes = interval, max_bytes, host_bytes
        self.disk, self.on_finish = disk, on_finish
        self._disk_dir, self._own_dir = disk_dir, disk_dir is None
        self.entries: OrderedDict[bytes, Checkpoint] = OrderedDict()     # least recently used first
        self._lengths: Counter = Counter()
        self._page_holders: Counter = Counter()                            # page -> device checkpoints
        self.stats = Counter()
        self.engine = None

    def attach(self, engine) -> None:
        if self.engine is not None and self.engine is not engine:
            raise ArgumentError("a PrefixCache serves one engine")
        self.engine = engine

    @property
    def pool(self):
        return self.engine.pool

    # -- accounting ---------------------------------------------------------------------------------------------
    def tier_bytes(self, tier: str) -> int:
        n = sum(c.nbytes() for c in self.entries.values() if c.tier == tier)
        if tier == "device":
            n += len(self._page_holders) * self.pool.page_bytes
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

    def resume(self, seq: SeqState) -> None:
        """Start `seq` (fresh, not admitted yet) from the deepest checkpoint inside its prompt, if any."""
        c = self.lookup(seq.tokens, seq.prompt_len)
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
            parts = self._load(c)
            pool.write_rows(pages, parts["latent"], c.length)
            kda = {i: KDAState(s.state.to(eng.device), tuple(t.to(eng.device) for t in s.conv))
                   for i, s in parts["kda"].items()}
        seq.pages, seq.length, seq.resumed = pages, c.length, c.length
        seq.kda = {i: (kda[i], 0) for i in eng.kda_layers}
        seq.last_logits = c.logits.to(eng.device)
        self.entries.move_to_end(c.key)

    def record(self, seq: SeqState) -> None:
        self.stats["requests"] += 1
        self.stats["hits"] += bool(seq.resumed)
        self.stats["hit_tokens"] += seq.resumed
        self.stats["prompt_tokens"] += seq.prompt_len

    # -- insert and evict ---------------------------------------------------------------------------------------
    def insert(self, seq: SeqState) -> None:
        """Checkpoint the first seq.length tokens of a sequence (its state right now)."""
        n = seq.length
        if n == 0 or seq.last_logits is None:
            return
        key = _key(seq.tokens[:n])
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        pages = list(seq.pages[: self.pool.pages_for(n)])
        self.pool.incref(pages)
        for p in pages:
            self._page_holders[p] += 1
        kda = {i: clone_row(seq.kda[i]) for i in self.engine.kda_layers}
        self.entries[key] = Checkpoint(key, n, kda, seq.last_logits.detach().clone(), pages=pages)
        self._lengths[n] += 1
        self.stats["inserted"] += 1
        self._enforce()

    def _enforce(self) -> None:
        while self.tier_bytes("device") > self.max_bytes and self._demote_lru("device"):
            pass
        while self.host_bytes and self.tier_bytes("host") > self.host_bytes and self._demote_lru("host"):
            pass

    def evict_for_pages(self) -> bool:
        """Move the least recently used device checkpoint off the pages (the engine needs room). False: none."""
        return self._demote_lru("device")

    def _demote_lru(self, tier: str) -> bool:
        for c in self.entries.values():
            if c.tier == tier:
                self._demote(c)
                return True
        return False

    def _release_pages(self, c: Checkpoint) -> None:
        for p in c.pages:
            self._page_holders[p] -= 1
            if not self._page_holders[p]:
                del self._page_holders[p]
        self.pool.decref(c.pages)
        c.pages = None

    def _demote(self, c: Checkpoint) -> None:
        if c.tier == "device":
            if self.host_bytes or self.disk:
                c.latent = self.pool.read_rows(c.pages, c.length)
            self._release_pages(c)
            if self.host_bytes:
                pin = self.engine.device.type == "cuda"
                c.kda = {i: KDAState(_host(s.state, pin), tuple(_host(t, pin) for t in s.conv))
                         for i, s in c.kda.items()}
                c.latent = {i: _host(t, pin) for i, t in c.latent.items()}
                c.logits = _host(c.logits, pin)
                c.tier = "host"
                self.stats["offloaded_host"] += 1
                return
        if self.disk:
            self._to_disk(c)
            return
        self._drop(c)

    def _to_disk(self, c: Checkpoint) -> None:
        from safetensors.torch import save_file

        if self._disk_dir is None:
            self._disk_dir = tempfile.mkdtemp(prefix="k3c-prefix-")
        os.makedirs(self._disk_dir, exist_ok=True)
        tensors = {"logits": c.logits}
        for i, s in c.kda.items():
            tensors[f"kda.{i}.state"] = s.state
            for j, t in enumerate(s.conv):
                tensors[f"kda.{i}.conv{j}"] = t
        for i, t in (c.latent or {}).items():
            tensors[f"mla.{i}"] = t
        c.path = os.path.join(self._disk_dir, c.key.hex()[:32] + ".safetensors")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, c.path)
        c.kda = {i: KDAState(s.state[:0], tuple(t[:0] for t in s.conv)) for i, s in c.kda.items()}  # shapes only
        c.latent, c.tier = None, "disk"
        self.stats["offloaded_disk"] += 1

    def _load(self, c: Checkpoint) -> dict:
        if c.tier == "host":
            return {"kda": c.kda, "latent": c.latent}
        from safetensors.torch import load_file

        t = load_file(c.path)
        c.logits = t["logits"]
        kda = {i: KDAState(t[f"kda.{i}.state"], tuple(t[f"kda.{i}.conv{j}"] for j in range(3))) for i in c.kda}
        latent = {int(k[4:]): v for k, v in t.items() if k.startswith("mla.")}
        return {"kda": kda, "latent": latent}

    def _drop(self, c: Checkpoint) -> None:
        if c.pages is not None:
            self._release_pages(c)
        if c.path and os.path.exists(c.path):
            os.unlink(c.path)
        del self.entries[c.key]
        self._lengths[c.length] -= 1
        if not self._lengths[c.length]:
            del self._lengths[c.length]
        self.stats["evicted"] += 1

    def clear(self) -> None:
        """Drop every checkpoint (their pages go back to the pool; files are deleted)."""
        for c in list(self.entries.values()):
            self._drop(c)
        if self._own_dir and self._disk_dir and os.path.isdir(self._disk_dir):
            shutil.rmtree(self._disk_dir, ignore_errors=True)
            self._disk_dir = None

    def tiers(self) -> Counter:
        return Counter(c.tier for c in self.entries.values())


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = t.detach().to("cpu")
    return out.pin_memory() if pin else out
