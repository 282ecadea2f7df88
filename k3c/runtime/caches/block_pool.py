"""The page pool of the paged MLA latent cache.

One page id addresses the same page in every MLA layer's pool tensor [num_pages, page_size, L+R], so a sequence
holds one list of page ids for all its MLA layers and a batch's block table (int32 [B, max_pages], what the MLA
kernels read) is built once per step. Pages are reference counted: a running sequence and prefix-cache checkpoints
may hold the same page. `filled[p]` is the page's high-water mark (rows written so far): a holder may append in
place only at or past it; writing below it (a second continuation of a shared page) copies the page first.
"""
from __future__ import annotations

import torch

from ...errors import UserError


class CacheFullError(UserError):
    """The MLA page pool cannot hold what a call needs (raised before any state changes)."""


class BlockPool:
    def __init__(self, num_pages: int, page_size: int, widths: dict[int, int], dtype: torch.dtype, device):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        # layer -> pool tensor; empty for a model without MLA layers (then no page is ever needed). One page more
        # than num_pages: `scratch`, never handed out, where the padding rows of a graph call run for a smaller
        # batch write their rows (GraphPool.step)
        self.pools = {layer: torch.zeros(num_pages + 1, page_size, w, dtype=dtype, device=device)
                      for layer, w in widths.items()}
        self.scratch = num_pages
        self.ref = [0] * num_pages
        self.filled = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))        # pop() hands out low ids first

    @property
    def used(self) -> bool:
        return bool(self.pools)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page id across every MLA layer."""
        return sum(p[0].numel() * p.element_size() for p in self.pools.values())

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size) if self.used else 0

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"MLA cache full: {n} pages needed, {len(self._free)} of {self.num_pages} free "
                                 f"(page size {self.page_size}); finish requests or give the engine more num_pages")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self.ref[p], self.filled[p] = 1, 0
        return out

    def incref(self, pages) -> None:
        for p in pages:
            if self.ref[p] <= 0:
                raise RuntimeError(f"page {p} is not allocated")
            self.ref[p] += 1

    def decref(self, pages) -> None:
        for p in pages:
            if self.ref[p] <= 0:
                raise RuntimeError(f"page {p} released more often than held")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self.filled[p] = 0
                self._free.append(p)

    def copy_page(self, src: int, dst: int, rows: int) -> None:
        """The first `rows` rows of page src into page dst, in every MLA layer."""
        for pool in self.pools.values():
            pool[dst, :rows].copy_(pool[src, :rows])
        self.filled[dst] = rows

    def needs_copy(self, page: int, offset: int) -> bool:
        """Whether writing at row `offset` of a held page must copy it first (another holder wrote there)."""
        return self.ref[page] > 1 and self.filled[page] > offset

    def mark_written(self, pages: list[int], start: int, stop: int) -> None:
        """Rows [start, stop) of a sequence with these pages were written (nothing to track without MLA layers)."""
        if not self.used:
            return
        ps = self.page_size
        for pos_page in range(start // ps, -(-stop // ps)):
            end = min(stop - pos_page * ps, ps)
            p = pages[pos_page]
            self.filled[p] = max(self.filled[p], end)

    def read_rows(self, pages: list[int], length: int) -> dict[int, torch.Tensor]:
        """Rows [0, length) of a page list, per layer: {layer: [length, W]} (copies)."""
        idx = torch.tensor(pages[: self.pages_for(length)], dtype=torch.long)
        return {layer: pool[idx.to(pool.device)].flatten(0, 1)[:length].clone() for layer, pool in self.pools.items()}

    def page_rows(self, page: int, rows: int) -> dict[int, torch.Tensor]:
        """Rows [0, rows) of one page, per layer (views into the pools)."""
        return {layer: pool[page, :rows] for layer, pool in self.pools.items()}

    def write_page(self, page: int, rows: dict[int, torch.Tensor]) -> None:
        """Fill a held page with rows {layer: [r, W]} (r <= page_size), asynchronously from pinned host memory."""
        n = 0
        for layer, pool in self.pools.items():
            src = rows[layer]
            n = src.shape[0]
            pool[page, :n].copy_(src, non_blocking=True)
        self.filled[page] = max(self.filled[page], n)

    def write_rows(self, pages: list[int], rows: dict[int, torch.Tensor], length: int) -> None:
        """Fill freshly allocated pages with rows [0, length) (the inverse of read_rows)."""
        n = self.pages_for(length)
        ps = self.page_size
        for layer, pool in self.pools.items():
            src = rows[layer].to(pool.device, pool.dtype)
            for i, p in enumerate(pages[:n]):
                chunk = src[i * ps:(i + 1) * ps]
                pool[p, : chunk.shape[0]] = chunk
        self.mark_written(pages, 0, length)

    def block_table(self, page_lists: list[list[int]], device, h2d=None) -> torch.Tensor:
        """int32 [B, max pages]; short rows padded with page 0 (never read: kernels stop at each length). Built
        as one host tensor; `h2d(t)` moves it to the device (default t.to(device))."""
        width = max(1, max((len(p) for p in page_lists), default=1))
        bt = torch.tensor([list(p) + [0] * (width - len(p)) for p in page_lists], dtype=torch.int32)
        return h2d(bt) if h2d is not None else bt.to(device)

    def check_empty(self) -> None:
        """Every page back in the free list (tests: refcounts returned to zero)."""
        held = [p for p, r in enumerate(self.ref) if r]
        if held or len(self._free) != self.num_pages:
            raise AssertionError(f"{len(held)} pages still held: {held[:8]}")
