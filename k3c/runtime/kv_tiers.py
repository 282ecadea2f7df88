"""KV memory tiers below the device page pool: pinned host memory and disk, each page's rows stored once per tier.

Rows [0, r) of the page at index i of a sequence hold the MLA latents of tokens [i*ps, i*ps + r), and those depend
on tokens [0, i*ps + r) only, so the SHA-256 of that token prefix names the page's content (page_keys). On the
device, checkpoints of one session (prompt ends, finishes, every interval) share their full pages by reference
count; a tier keeps that sharing by storing a page once per key and counting its holders: eight checkpoints of a
growing context hold each full page once, not eight times (only a checkpoint's own partial last page is its own).

Device -> host copies are non-blocking into pinned memory on the compute stream: the host thread goes on
scheduling while the copy engine drains them, and a device page released right after its copy was queued cannot be
overwritten first (later kernels run after it on the same stream). Host -> device copies are non-blocking from
pinned memory likewise (the caching host allocator keeps a source alive until its copy ran). Only a host-side read
of copied rows (writing them to disk) waits for the copies (`HostTier.settle`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections import Counter

import numpy as np
import torch


def page_keys(tokens, length: int, page_size: int) -> list[bytes]:
    """One content key per page of the first `length` tokens: SHA-256 of the token prefix the page's rows end at."""
    arr = np.asarray(tokens[:length], dtype=np.int64)
    if len(arr) != length:
        raise ValueError(f"page_keys: {len(arr)} tokens given for a length of {length}")
    h, keys = hashlib.sha256(), []
    for start in range(0, length, page_size):
        h.update(arr[start:start + page_size].tobytes())
        keys.append(h.copy().digest())
    return keys


def rows_bytes(rows: dict[int, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in rows.values())


class RowTier:
    """Pages' rows ({MLA layer: [rows, W]}) by content key, reference counted by the checkpoints that hold them."""
    name = "tier"

    def __init__(self):
        self._ref: Counter = Counter()
        self._bytes: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._ref

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    @property
    def pages(self) -> int:
        return len(self._ref)

    def hold(self, key: bytes, rows_fn) -> bool:
        """One more holder of the page `key`; its rows come from rows_fn() only if this tier has none. Returns
        whether rows were stored (False: shared with an earlier holder)."""
        if key in self._ref:
            self._ref[key] += 1
            return False
        rows = rows_fn()
        self._store(key, rows)
        self._ref[key] = 1
        self._bytes[key] = rows_bytes(rows)
        return True

    def release(self, key: bytes) -> None:
        if self._ref[key] <= 0:
            raise RuntimeError(f"{self.name} page {key.hex()[:12]} released more often than held")
        self._ref[key] -= 1
        if not self._ref[key]:
            del self._ref[key], self._bytes[key]
            self._delete(key)

    def rows(self, key: bytes) -> dict[int, torch.Tensor]:
        raise NotImplementedError

    def _store(self, key: bytes, rows: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError

    def _delete(self, key: bytes) -> None:
        raise NotImplementedError


class HostTier(RowTier):
    """Host memory (pinned with CUDA, so copies both ways are asynchronous)."""
    name = "host"

    def __init__(self, pin: bool):
        super().__init__()
        self.pin = pin
        self._rows: dict[bytes, dict[int, torch.Tensor]] = {}
        self._event = None                   # the last queued device -> host copy (CUDA)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor, queued without a host sync when pinned."""
        if not self.pin:
            return t.detach().to("cpu").clone() if t.device.type == "cpu" else t.detach().to("cpu")
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t.detach(), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return out

    def settle(self) -> None:
        """Wait for the queued device -> host copies (before the host itself reads their rows)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def rows(self, key: bytes) -> dict[int, torch.Tensor]:
        return self._rows[key]

    def _store(self, key, rows):
        self._rows[key] = rows

    def _delete(self, key):
        del self._rows[key]


class DiskTier(RowTier):
    """safetensors files in a directory (a temp dir unless one is named), one per page key."""
    name = "disk"

    def __init__(self, directory: str | None = None):
        super().__init__()
        self._dir, self._own = directory, directory is None

    @property
    def directory(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="k3c-kv-")
        os.makedirs(self._dir, exist_ok=True)
        return self._dir

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name + ".safetensors")

    def save(self, name: str, tensors: dict[str, torch.Tensor]) -> str:
        from safetensors.torch import save_file

        path = self.path(name)
        tmp = path + ".tmp"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)                 # never a half-written file under the final name
        return path

    def load(self, name: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(self.path(name))

    def remove(self, name: str) -> None:
        p = self.path(name)
        if os.path.exists(p):
            os.unlink(p)

    def rows(self, key: bytes) -> dict[int, torch.Tensor]:
        return {int(k[4:]): v for k, v in self.load("page-" + key.hex()[:40]).items()}

    def _store(self, key, rows):
        self.save("page-" + key.hex()[:40], {f"mla.{layer}": t for layer, t in rows.items()})

    def _delete(self, key):
        self.remove("page-" + key.hex()[:40])

    def cleanup(self) -> None:
        """Remove the temp directory this tier made (a named one is left, emptied of this tier's files)."""
        if self._own and self._dir and os.path.isdir(self._dir):
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
